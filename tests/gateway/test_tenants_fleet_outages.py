"""Redis as a cache of what the replicas know (issue 46): it is SIGKILLed and comes back empty,
or pauses, while aliases, keys, concurrency leases and audit entries exist; afterwards every
alias serves on every replica, a running stream's lease counts again and a gone client's slot is
free at once, and GET /admin/audit lists every entry. The fleet and its world come from
tenant_fleet.py; each test makes what it checks, so any test passes alone and in any order.
"""

from __future__ import annotations

import secrets
import time

import pytest
from held_streams import hold
from tenant_fleet import (
    OP,
    RIDS,
    assert_rate_limited,
    call,
    complete,
    fleet_fixture,  # noqa: F401 (a fixture)
    key,
    minted,
    wait_until,
    world_fixture,  # noqa: F401 (a fixture)
)

pytestmark = pytest.mark.slow  # replica processes on one redis-server

PAUSE_S = 4.0  # the reliability probe's Redis blip


def put_alias(fleet, rid: str, by: str, name: str, target: str) -> None:
    response = call(fleet, rid, "PUT", f"/admin/aliases/{name}", by,
                    json={"targets": [{"adapter": target, "weight": 1}]})
    assert response.status_code == 200, response.text


def audit(fleet, rid: str) -> list[dict]:
    response = call(fleet, rid, "GET", "/admin/audit?limit=1000", OP)
    assert response.status_code == 200, response.text
    return response.json()["data"]


def stored_aliases(fleet) -> set[str]:
    return {k.decode() for k in fleet.redis.hkeys(f"{fleet.prefix()}aliases")}


@pytest.mark.usefixtures("world")
def test_aliases_leases_and_the_audit_trail_outlive_redis_coming_back_empty(fleet):
    tag = secrets.token_hex(3)
    acme = key(fleet, "acme-admin")
    # aliases written through each replica, one of them a tenant's; each write audited
    aliases = {f"pirate-{tag}": (OP, "pirate"), f"acme/bot-{tag}": (acme, "acme/bot")}
    for rid, (name, (by, target)) in zip(RIDS, aliases.items(), strict=True):
        put_alias(fleet, rid, by, name, target)
    limited = minted(fleet, "r2", "acme", acme, role="member", max_concurrency=1)
    for rid in RIDS:
        wait_until(f"{rid} to serve the aliases and know the key", lambda rid=rid: all(
            complete(fleet, rid, by, name).status_code == 200
            for name, (by, _) in aliases.items())
            and complete(fleet, rid, limited["key"]).status_code == 200, timeout=5)
    trail = audit(fleet, "r1")
    assert {f"pirate-{tag}", f"acme/bot-{tag}"} <= {e["adapter_id"] for e in trail}
    assert limited["id"] in {e["target_key_id"] for e in trail}

    stream = hold(fleet, "r1", limited["key"])  # a lease in Redis, renewed by r1
    try:
        assert stream.status == 200
        fleet.redis_server.kill()
        fleet.redis_server.start()  # back on the same port, empty
        wait_until("the replicas to write the aliases back",
                   lambda: set(aliases) <= stored_aliases(fleet), timeout=10)
        # the running stream's lease is written back too: the key is still at its limit
        wait_until("r1 to re-create the lease", lambda: complete(
            fleet, "r2", limited["key"]).status_code == 429, timeout=5)
        assert_rate_limited(complete(fleet, "r2", limited["key"]))
    finally:
        stream.close()
    wait_until("the slot to free after the client left", lambda: complete(
        fleet, "r2", limited["key"]).status_code == 200, timeout=3)

    for rid in RIDS:
        for name, (by, _) in aliases.items():
            response = complete(fleet, rid, by, name)
            assert response.status_code == 200, (rid, name, response.text)
            assert response.json()["model"] == name
        wait_until(f"{rid} to list every audit entry", lambda rid=rid: all(
            entry in audit(fleet, rid) for entry in trail), timeout=10)
    assert fleet.redis.xlen("loragw:audit") >= len(trail)  # Redis's copy whole again
    ids = [e["id"] for e in audit(fleet, "r2")]
    assert len(ids) == len(set(ids))  # each entry once, though both replicas put them back


@pytest.mark.usefixtures("world")
def test_a_gone_clients_slot_is_freed_as_soon_as_a_paused_redis_answers(fleet):
    limited = minted(fleet, "r1", "acme", key(fleet, "acme-admin"), role="member",
                     max_concurrency=1)
    stream = hold(fleet, "r1", limited["key"])
    assert stream.status == 200
    fleet.redis.client_pause(int(PAUSE_S * 1000))  # every client waits; one that gives up is dropped
    paused = time.monotonic()
    stream.close()  # the client leaves while the release cannot reach Redis
    time.sleep(max(0.0, PAUSE_S - (time.monotonic() - paused)))
    # a replica that forgot the release would refuse the key until its lease lapsed (60 s)
    wait_until("the slot to free once Redis answers", lambda: complete(
        fleet, "r2", limited["key"]).status_code == 200, timeout=5)
