"""Tenants across a fleet, tested as an attacker would (DESIGN.md "Tenants"): keys minted on one
replica work on the other, revocation and rotation reach it, the audit log shows each tenant
only its own, and keys and limits outlive a Redis outage. The fleet and its world of tenants
come from tenant_fleet.py (shared with test_tenants_fleet_namespaces.py and
test_tenants_fleet_limits.py); each test makes the keys it checks, so any test passes alone
and in any order.
"""

from __future__ import annotations

import secrets
import time

import pytest
from fleet_harness import served_by
from tenant_fleet import (
    BASE,
    OP,
    REVOKE_WITHIN_S,
    RIDS,
    TenantFleet,
    call,
    complete,
    error,
    fleet_fixture,  # noqa: F401 (a fixture)
    key,
    mint,
    minted,
    model_ids,
    revoked_fixture,  # noqa: F401 (a fixture)
    rotated_fixture,  # noqa: F401 (a fixture)
    upload,
    wait_until,
    whole,
    world_fixture,  # noqa: F401 (a fixture)
)

pytestmark = pytest.mark.slow  # replica processes on one redis-server

KEY_FIELDS = {"id", "key", "tenant", "role", "adapters", "rpm", "tpm", "max_concurrency",
              "created"}






def key_ids(fleet: TenantFleet, rid: str, tenant: str, by: str) -> set[str]:
    listing = call(fleet, rid, "GET", f"/admin/tenants/{tenant}/keys", by)
    assert listing.status_code == 200, listing.text
    return {k["id"] for k in listing.json()["data"]}


# ---- 1. keys --------------------------------------------------------------------------------
def test_keys_minted_on_one_replica_are_listed_and_work_on_the_other(fleet):
    before = key_ids(fleet, "r2", "acme", OP)  # acme's keys other tests minted
    acme = minted(fleet, "r1", "acme", OP, role="admin")
    assert set(acme) == KEY_FIELDS, acme
    assert acme["tenant"] == "acme" and acme["role"] == "admin" and acme["adapters"] == []
    assert acme["key"].startswith("lgw-") and acme["rpm"] is None
    member = minted(fleet, "r1", "acme", acme["key"], role="member", adapters=["acme/bot*"])
    assert member["role"] == "member" and member["adapters"] == ["acme/bot*"]
    globex = minted(fleet, "r1", "globex", OP, role="admin")
    secrets_shown = {acme["key"], member["key"], globex["key"]}
    assert len(secrets_shown) == 3

    # listed on r2 at once, without secrets; a tenant admin sees its own tenant's only
    listing = call(fleet, "r2", "GET", "/admin/tenants/acme/keys", OP)
    assert listing.status_code == 200, listing.text
    listed = {k["id"]: k for k in listing.json()["data"]}
    assert set(listed) == before | {acme["id"], member["id"]}
    for entry in listed.values():
        assert "key" not in entry and KEY_FIELDS - {"key"} <= set(entry), entry
    assert not any(s in listing.text for s in secrets_shown)
    mine = call(fleet, "r2", "GET", "/admin/tenants/acme/keys", acme["key"])
    assert {k["id"] for k in mine.json()["data"]} == set(listed)
    assert globex["id"] not in mine.text

    # every minted key works on r2 the moment it exists
    for minted_key in (acme, member, globex):
        assert BASE in model_ids(fleet, "r2", minted_key["key"])
    assert complete(fleet, "r2", member["key"]).status_code == 200
    # ... and its use shows as last_used, on both replicas, within a heartbeat or two
    for rid in RIDS:
        wait_until(f"last_used of the member key on {rid}", lambda rid=rid: next(
            k for k in call(fleet, rid, "GET", "/admin/tenants/acme/keys", OP).json()["data"]
            if k["id"] == member["id"]).get("last_used"), timeout=4)
    # no key, or a key nobody issued: 401
    for by in (None, "lgw-" + secrets.token_urlsafe(32), "not-a-key"):
        response = call(fleet, "r2", "GET", "/v1/models", by)
        assert response.status_code == 401 and error(response)["code"] == "invalid_api_key"


# ---- 5. revocation and rotation reach the other replica -----------------------------------
@pytest.mark.usefixtures("world")
def test_revocation_and_rotation_reach_the_other_replica(fleet):
    acme = key(fleet, "acme-admin")
    victim = minted(fleet, "r1", "acme", acme, role="member")
    for rid in RIDS:  # both replicas know it (r2 from its mirror after this)
        assert complete(fleet, rid, victim["key"]).status_code == 200
    assert call(fleet, "r1", "DELETE", f"/admin/tenants/acme/keys/{victim['id']}",
                acme).status_code == 200
    assert call(fleet, "r1", "GET", "/v1/models", victim["key"]).status_code == 401
    waited = wait_until("r2 to refuse the revoked key", lambda: call(
        fleet, "r2", "GET", "/v1/models", victim["key"]).status_code == 401, REVOKE_WITHIN_S)
    assert waited <= REVOKE_WITHIN_S
    response = complete(fleet, "r2", victim["key"])
    assert response.status_code == 401 and error(response)["code"] == "invalid_api_key"
    listed = call(fleet, "r2", "GET", "/admin/tenants/acme/keys", OP).json()["data"]
    assert victim["id"] not in {k["id"] for k in listed}
    assert call(fleet, "r2", "DELETE", f"/admin/tenants/acme/keys/{victim['id']}",
                acme).status_code == 404

    # rotation on r2 with a grace: the new key works on r1 at once, the old one until the grace
    old = minted(fleet, "r1", "acme", acme, role="member")
    for rid in RIDS:
        assert complete(fleet, rid, old["key"]).status_code == 200
    grace = 2
    rotated = call(fleet, "r2", "POST", f"/admin/tenants/acme/keys/{old['id']}/rotate", acme,
                   json={"grace_seconds": grace})
    rotated_at = time.monotonic()
    assert rotated.status_code == 200, rotated.text
    new = rotated.json()
    assert new["id"] == old["id"] and new["key"] != old["key"]
    for rid in RIDS:
        assert complete(fleet, rid, new["key"]).status_code == 200
        assert complete(fleet, rid, old["key"]).status_code == 200
    assert time.monotonic() - rotated_at < grace  # the checks above ran inside the grace
    for rid in RIDS:
        wait_until(f"{rid} to refuse the old key", lambda rid=rid: call(
            fleet, rid, "GET", "/v1/models", old["key"]).status_code == 401,
            grace + REVOKE_WITHIN_S)
        assert complete(fleet, rid, old["key"]).status_code == 401
        assert complete(fleet, rid, new["key"]).status_code == 200
    assert time.monotonic() - rotated_at >= grace - 0.5


# ---- 9. the audit log -------------------------------------------------------------------
def test_the_audit_log_shows_each_tenant_only_its_own(fleet):
    # a history of its own, made now: the test rests on no other test's
    acme_admin = minted(fleet, "r1", "acme", OP, role="admin")
    acme_member = minted(fleet, "r1", "acme", acme_admin["key"], role="member")
    globex_admin = minted(fleet, "r1", "globex", OP, role="admin")
    acme_id, shared_id, globex_id = "acme/audited", "audited", "globex/audited"
    for rid, by, adapter_id, folder in (
            ("r1", acme_admin["key"], acme_id, "audited-acme"),
            ("r2", OP, shared_id, "audited-shared"),
            ("r2", globex_admin["key"], globex_id, "audited-globex")):
        response = upload(fleet, rid, by, adapter_id, fleet.folders[folder])
        assert response.status_code == 201, response.text
    victim = minted(fleet, "r1", "acme", acme_admin["key"], role="member")
    assert call(fleet, "r2", "DELETE", f"/admin/tenants/acme/keys/{victim['id']}",
                acme_admin["key"]).status_code == 200
    turned = minted(fleet, "r1", "acme", acme_admin["key"], role="member")
    assert call(fleet, "r2", "POST", f"/admin/tenants/acme/keys/{turned['id']}/rotate",
                acme_admin["key"], json={}).status_code == 200

    everything = call(fleet, "r2", "GET", "/admin/audit?limit=1000", OP)
    assert everything.status_code == 200, everything.text
    entries = everything.json()["data"]
    for entry in entries:
        assert {"time", "key_id", "tenant", "action", "adapter_id", "version",
                "sha256"} <= set(entry), entry
    times = [e["time"] for e in entries]
    assert times == sorted(times, reverse=True)
    created = {e["target_key_id"]: e for e in entries if e["action"] == "key.created"}
    assert created[acme_admin["id"]]["key_id"] == "operator"
    assert created[acme_admin["id"]]["tenant"] is None
    assert created[acme_member["id"]]["key_id"] == acme_admin["id"]
    assert created[acme_member["id"]]["tenant"] == "acme"
    uploads = {e["adapter_id"]: e for e in entries if e["action"] == "adapter.uploaded"}
    bot = call(fleet, "r1", "GET", f"/admin/adapters/{acme_id}", OP).json()
    assert uploads[acme_id]["key_id"] == acme_admin["id"]
    assert uploads[acme_id]["tenant"] == "acme"
    assert (uploads[acme_id]["version"], uploads[acme_id]["sha256"]) == (
        bot["version"], bot["sha256"])
    assert uploads[shared_id]["key_id"] == "operator" and uploads[shared_id]["tenant"] is None
    assert uploads[globex_id]["key_id"] == globex_admin["id"]
    assert any(e["action"] == "key.revoked" and e["target_key_id"] == victim["id"]
               for e in entries)
    assert any(e["action"] == "key.rotated" and e["target_key_id"] == turned["id"]
               for e in entries)

    for rid in RIDS:
        for tenant, admin in (("acme", acme_admin), ("globex", globex_admin)):
            mine = call(fleet, rid, "GET", "/admin/audit?limit=1000", admin["key"])
            assert mine.status_code == 200, mine.text
            seen = mine.json()["data"]
            assert seen and all(tenant in (e["tenant"], e.get("owner")) for e in seen), seen
            assert seen == [e for e in entries if tenant in (e["tenant"], e.get("owner"))]
        acme_seen = call(fleet, rid, "GET", "/admin/audit?limit=1000",
                         acme_admin["key"]).json()["data"]
        assert acme_id in {e["adapter_id"] for e in acme_seen}
        assert not {shared_id, globex_id} & {e["adapter_id"] for e in acme_seen}
        assert globex_admin["id"] not in {e.get("target_key_id") for e in acme_seen}
        one = call(fleet, rid, "GET", "/admin/audit?limit=1", acme_admin["key"])
        assert one.json()["data"] == acme_seen[:1]
        member = call(fleet, rid, "GET", "/admin/audit", acme_member["key"])
        assert member.status_code == 403, member.text


# ---- 10. Redis dies, and comes back empty ------------------------------------------------
@pytest.mark.usefixtures("world", "revoked", "rotated")
def test_keys_and_limits_outlive_a_redis_outage(fleet):
    limited = minted(fleet, "r1", "acme", key(fleet, "acme-admin"), role="member", rpm=2)
    # r2 mirrors it (a listing reads the store) before Redis goes
    assert limited["id"] in call(fleet, "r2", "GET", "/admin/tenants/acme/keys", OP).text
    known = ("acme-admin", "acme-member", "globex-admin", "rotated")
    known_ids = {fleet.keys[n]["id"] for n in known} | {limited["id"]}
    fleet.redis_server.kill()
    try:
        for rid in RIDS:
            for name in known:
                response = complete(fleet, rid, key(fleet, name))
                assert response.status_code == 200, (rid, name, response.text)
            stranger = complete(fleet, rid, "lgw-" + secrets.token_urlsafe(32))
            assert stranger.status_code == 401, stranger.text
            assert complete(fleet, rid, key(fleet, "victim")).status_code == 401
            # the limit holds per replica while the fleet cannot share counts
            statuses = [complete(fleet, rid, limited["key"]).status_code for _ in range(3)]
            assert statuses == [200, 200, 429], (rid, statuses)
            # writes to the key store fail, and say so
            response = mint(fleet, rid, "acme", OP, role="member")
            assert response.status_code == 503, response.text
    finally:
        fleet.redis_server.start()  # back on the same port, empty
    wait_until("the replicas to write back the keys they know", lambda: known_ids <= {
        k.decode() for k in fleet.redis.hkeys("loragw:tenant:keys")}, timeout=6)
    for rid in RIDS:
        for name in known:
            assert complete(fleet, rid, key(fleet, name)).status_code == 200, (rid, name)
    # the store is whole again: a key minted now works on the other replica at once
    fresh = minted(fleet, "r2", "globex", OP, role="member")
    assert complete(fleet, "r1", fresh["key"]).status_code == 200
    assert complete(fleet, "r1", key(fleet, "victim")).status_code == 401


@pytest.fixture
def redis_came_back_empty(world, fleet) -> None:
    """Redis restarted empty, and the replicas' write-back of the world done."""
    fleet.redis_server.restart()
    wait_until("the replicas to write the world back", lambda: whole(fleet), timeout=10)


@pytest.mark.usefixtures("redis_came_back_empty")
def test_a_replica_started_after_redis_came_back_empty_can_forward(fleet):
    fleet.start("r3")
    try:
        member = minted(fleet, "r1", "acme", key(fleet, "acme-admin"), role="member")
        call(fleet, "r3", "GET", "/admin/tenants/acme/keys", OP)  # r3 mirrors it
        response = complete(fleet, "r3", member["key"], "acme/bot")
        assert response.status_code == 200, response.text
        assert served_by(response) == "r1"
    finally:  # the shared fleet goes on with r1 and r2 only, as the other tests expect
        fleet.retire("r3")
