"""Tenants' namespaces across a fleet, tested as an attacker would (DESIGN.md "Tenants"): an
adapter another tenant owns is answered like one that does not exist; paths that climb out of
a namespace, and writes a role does not allow, change nothing: the catalog in Redis and the
operator's view of every adapter on both replicas are the same before and after. The fleet and
its world (tenant_fleet.py) are shared with the other test_tenants_fleet* modules.
"""

from __future__ import annotations

import pytest
from tenant_fleet import (
    BASE,
    OP,
    RIDS,
    TenantFleet,
    admin_ids,
    call,
    complete,
    error,
    fleet_fixture,  # noqa: F401 (a fixture)
    key,
    mint,
    model_ids,
    raw_call,
    shape,
    unchanged,
    upload,
    wait_until,
    world_fixture,  # noqa: F401 (a fixture)
)
from uploads import read_files

pytestmark = pytest.mark.slow  # replica processes on one redis-server




def probes(adapter_id: str) -> list[tuple[str, str, dict | None]]:
    """Every route that names an adapter, asked about `adapter_id`."""
    return [
        ("POST", "/v1/completions", {"model": adapter_id, "prompt": "hi", "max_tokens": 1}),
        ("POST", "/v1/completions", {"model": adapter_id, "prompt": "hi", "max_tokens": 1,
                                     "stream": True}),
        ("POST", "/v1/chat/completions", {"model": adapter_id, "max_tokens": 1,
                                          "messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/v1/responses", {"model": adapter_id, "input": "hi", "max_output_tokens": 1}),
        ("GET", f"/v1/models/{adapter_id}", None),
        ("POST", "/tokenize", {"model": adapter_id, "prompt": "hi"}),
        ("POST", "/detokenize", {"model": adapter_id, "tokens": [5, 6]}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": adapter_id}),
        ("GET", f"/admin/adapters/{adapter_id}", None),
        ("DELETE", f"/admin/adapters/{adapter_id}", None),
        ("POST", f"/admin/adapters/{adapter_id}/pin", None),
        ("POST", f"/admin/adapters/{adapter_id}/unpin", None),
        ("POST", f"/admin/adapters/{adapter_id}/evict", None),
        ("POST", f"/admin/adapters/{adapter_id}/load", None),
    ]


def assert_hidden(fleet: TenantFleet, by: str, hidden: str, *missing: str) -> None:
    """`by` asking about `hidden` is answered on every route and replica exactly as asking
    about each of `missing` (ids nobody registered)."""
    for rid in RIDS:
        for (method, path, body), *others in zip(probes(hidden),
                                                 *(probes(m) for m in missing)):
            got = call(fleet, rid, method, path, by, json=body)
            assert got.status_code == 404, (rid, method, path, got.status_code, got.text)
            for (_, other_path, other_body), other in zip(others, missing):
                want = call(fleet, rid, method, other_path, by, json=other_body)
                assert shape(got, hidden) == shape(want, other), (rid, method, path)


def owned(fleet: TenantFleet, rid: str, *owners: str) -> set[str]:
    """The adapters on `rid` whose owner, as the operator sees it, is one of `owners` ("":
    shared): what a tenant's admin is shown, the shared ones and its own."""
    response = call(fleet, rid, "GET", "/admin/adapters", OP)
    assert response.status_code == 200, response.text
    return {a["id"] for a in response.json()["data"] if a["owner"] in owners}


# ---- 2. an adapter another tenant owns is one that does not exist ------------------------
OWN, SHARED, VENDOR = "acme/bot-private", "parrot", "vendor"  # uploaded by test 2 only


@pytest.mark.usefixtures("world")
def test_another_tenants_adapter_is_answered_like_a_missing_one(fleet):
    created = upload(fleet, "r1", key(fleet, "acme-admin"), OWN, fleet.folders["bot-private"])
    assert created.status_code == 201, created.text
    assert created.json()["owner"] == "acme"
    shared = upload(fleet, "r2", OP, SHARED, fleet.folders["parrot"])
    assert shared.status_code == 201, shared.text
    assert shared.json()["owner"] == ""
    for rid in RIDS:
        wait_until(f"{rid} to list both", lambda rid=rid: {OWN, SHARED}
                   <= model_ids(fleet, rid, OP), timeout=3)
        globex = model_ids(fleet, rid, key(fleet, "globex-admin"))
        assert {BASE, SHARED} <= globex and OWN not in globex
        assert admin_ids(fleet, rid, key(fleet, "globex-admin")) == owned(fleet, rid, "",
                                                                          "globex")
        assert {OWN, SHARED} <= model_ids(fleet, rid, key(fleet, "acme-member"))
        assert admin_ids(fleet, rid, key(fleet, "acme-admin")) == owned(fleet, rid, "", "acme")
    # the owner and the operator see it; every key may use the shared one
    assert complete(fleet, "r2", key(fleet, "acme-member"), OWN).status_code == 200
    assert complete(fleet, "r1", key(fleet, "globex-admin"), SHARED).status_code == 200
    assert call(fleet, "r2", "GET", f"/v1/models/{OWN}", OP).status_code == 200
    # the operator may give any id an owner: then only that tenant's keys see it
    vendor = upload(fleet, "r1", OP, VENDOR, fleet.folders["vendor"], owner="globex")
    assert vendor.status_code == 201 and vendor.json()["owner"] == "globex", vendor.text
    for rid in RIDS:
        wait_until(f"{rid} to list {VENDOR}", lambda rid=rid: VENDOR in model_ids(
            fleet, rid, key(fleet, "globex-admin")), timeout=3)
    with unchanged(fleet):
        assert_hidden(fleet, key(fleet, "globex-admin"), OWN, "globex/nope", "acme/nope")
        assert_hidden(fleet, key(fleet, "acme-admin"), VENDOR, "vendor-nope")
        for rid in RIDS:  # its owner uses it, but it is not in its namespace to change
            response = call(fleet, rid, "DELETE", f"/admin/adapters/{VENDOR}",
                            key(fleet, "globex-admin"))
            assert response.status_code == 403, response.text
    assert complete(fleet, "r2", key(fleet, "acme-member"), OWN).status_code == 200


# ---- 3. paths that try to leave a namespace ---------------------------------------------------
TRICKS = {  # (key name, path as sent)
    ("acme-admin", "acme/../globex/bot"), ("acme-admin", "acme%2F..%2Fglobex%2Fbot"),
    ("acme-admin", "acme/..%2Fglobex/bot"), ("acme-admin", "globex/bot/"),
    ("acme-admin", "globex/bot"), ("acme-admin", "/globex/bot"),
    ("acme-admin", "acme/bot/../../globex/bot"), ("acme-admin", "globex%2Fbot"),
    ("acme-admin", "./globex/bot"), ("globex-admin", "globex/../acme/bot"),
    ("globex-admin", "globex%2F..%2Facme%2Fbot"), ("globex-admin", "acme/bot/"),
    ("globex-admin", "acme%2Fbot"), ("globex-admin", "globex/./../acme/bot"),
}


@pytest.mark.usefixtures("world")  # acme/bot and globex/bot among them
def test_paths_that_climb_out_of_a_namespace_change_nothing(fleet):
    with unchanged(fleet):
        for name, path in sorted(TRICKS):
            for rid in RIDS:
                for method, route in (("GET", "/admin/adapters/{}"),
                                      ("DELETE", "/admin/adapters/{}"),
                                      ("POST", "/admin/adapters/{}/pin"),
                                      ("POST", "/admin/adapters/{}/evict"),
                                      ("GET", "/v1/models/{}")):
                    status, text = raw_call(fleet, rid, method, route.format(path),
                                            key(fleet, name))
                    assert status in (400, 403, 404), (name, method, path, status, text)
                    assert "sha256" not in text, (name, method, path, text)
            for adapter_id in {path, path.replace("%2F", "/")}:
                for replace in (False, True):
                    refused = upload(fleet, "r1", key(fleet, name), adapter_id,
                                     fleet.folders["evil"], replace=replace)
                    assert refused.status_code in (400, 403, 404), (name, adapter_id,
                                                                    refused.text)
    for rid in RIDS:  # the real ones are untouched and still served to their owners
        assert complete(fleet, rid, key(fleet, "globex-admin"), "globex/bot").status_code == 200


# ---- 4. roles --------------------------------------------------------------------------------
@pytest.mark.usefixtures("world")
def test_roles_and_namespaces_are_enforced(fleet):
    folders = fleet.folders
    member, acme, globex = (key(fleet, n) for n in ("acme-member", "acme-admin",
                                                     "globex-admin"))
    globex_id = fleet.keys["globex-admin"]["id"]
    config, weights = read_files(folders["evil"])
    files = {"adapter_config": ("adapter_config.json", config),
             "adapter_model": ("adapter_model.safetensors", weights)}
    member_routes = [
        ("GET", "/admin/adapters", {}), ("GET", "/admin/adapters/acme/bot", {}),
        ("POST", "/admin/adapters", {"data": {"adapter_id": "acme/bot2"}, "files": files}),
        ("POST", "/admin/adapters/register", {"json": {"adapter_id": "acme/bot3",
                                                       "source": folders["evil"]}}),
        ("DELETE", "/admin/adapters/acme/bot", {}),
        *(("POST", f"/admin/adapters/acme/bot/{verb}", {})
          for verb in ("pin", "unpin", "evict", "load")),
        ("GET", "/admin/tenants/acme/keys", {}),
        ("POST", "/admin/tenants/acme/keys", {"json": {"role": "admin"}}),
        ("POST", f"/admin/tenants/acme/keys/{fleet.keys['acme-member']['id']}/rotate",
         {"json": {}}),
        ("DELETE", f"/admin/tenants/acme/keys/{fleet.keys['acme-admin']['id']}", {}),
        ("GET", "/admin/audit", {}),
        ("POST", "/v1/load_lora_adapter", {"json": {"lora_name": "acme/bot4",
                                                    "lora_path": folders["evil"]}}),
        ("POST", "/v1/unload_lora_adapter", {"json": {"lora_name": "acme/bot"}}),
    ]
    other_tenant = [
        ("GET", "/admin/tenants/globex/keys", {}),
        ("POST", "/admin/tenants/globex/keys", {"json": {"role": "admin"}}),
        ("POST", f"/admin/tenants/globex/keys/{globex_id}/rotate", {"json": {}}),
        ("DELETE", f"/admin/tenants/globex/keys/{globex_id}", {}),
    ]
    with unchanged(fleet):
        keys_before = call(fleet, "r1", "GET", "/admin/tenants/acme/keys", OP).json()
        for rid in RIDS:
            for method, path, kw in member_routes:
                response = call(fleet, rid, method, path, member, **kw)
                assert response.status_code == 403, (rid, method, path, response.text)
                assert error(response)["code"] == "permission_denied"
            for method, path, kw in other_tenant:
                response = call(fleet, rid, method, path, acme, **kw)
                assert response.status_code == 403, (rid, method, path, response.text)
            # another tenant's key id under one's own tenant: no such key
            for method, path in (("POST", f"/admin/tenants/acme/keys/{globex_id}/rotate"),
                                 ("DELETE", f"/admin/tenants/acme/keys/{globex_id}")):
                response = call(fleet, rid, method, path, acme, json={} if method == "POST"
                                else None)
                assert response.status_code == 404, response.text
            # writes outside acme/...: 403, whether or not the id exists, alike
            assert shape(upload(fleet, rid, acme, "globex/bot", folders["evil"]),
                         "globex/bot") == shape(upload(fleet, rid, acme, "globex/none",
                                                       folders["evil"]), "globex/none")
            for adapter_id in ("globex/evil", "globex/bot", "evil", "pirate", "acme",
                               "Acme/evil", "acmex/evil", "acme-x/evil"):
                for replace in (False, True):
                    response = upload(fleet, rid, acme, adapter_id, folders["evil"], replace)
                    assert response.status_code == 403, (adapter_id, response.text)
                response = call(fleet, rid, "POST", "/admin/adapters/register", acme,
                                json={"adapter_id": adapter_id, "source": folders["evil"]})
                assert response.status_code == 403, (adapter_id, response.text)
                response = call(fleet, rid, "POST", "/v1/load_lora_adapter", acme,
                                json={"lora_name": adapter_id, "lora_path": folders["evil"]})
                assert response.status_code == 403, (adapter_id, response.text)
            # an owner other than itself, or shared, for an id in its own namespace
            for owner in ("globex", ""):
                response = upload(fleet, rid, acme, "acme/evil", folders["evil"], owner=owner)
                assert response.status_code == 403, (owner, response.text)
            # the operator's shared adapter: visible, never changeable by a tenant
            for method, path in (("DELETE", "/admin/adapters/pirate"),
                                 *(("POST", f"/admin/adapters/pirate/{v}")
                                   for v in ("pin", "unpin", "evict", "load"))):
                response = call(fleet, rid, method, path, acme)
                assert response.status_code == 403, (method, path, response.text)
            response = call(fleet, rid, "POST", "/v1/unload_lora_adapter", acme,
                            json={"lora_name": "pirate"})
            assert response.status_code == 403, response.text
            # no role but admin and member
            assert mint(fleet, rid, "acme", acme, role="operator").status_code == 400
        keys_after = call(fleet, "r1", "GET", "/admin/tenants/acme/keys", OP).json()
        strip = lambda keys: [{k: v for k, v in e.items() if k != "last_used"}  # noqa: E731
                              for e in keys["data"]]
        assert strip(keys_after) == strip(keys_before)
    assert all(complete(fleet, rid, globex).status_code == 200 for rid in RIDS)

    # the member's globs: acme/bot* only, even among acme's own adapters
    response = upload(fleet, "r1", acme, "acme/other", folders["other"])
    assert response.status_code == 201, response.text
    for rid in RIDS:
        wait_until(f"{rid} to list acme/other", lambda rid=rid: "acme/other"
                   in model_ids(fleet, rid, acme), timeout=3)
        visible = model_ids(fleet, rid, member)
        assert "acme/bot" in visible and "pirate" in visible and "acme/other" not in visible
    assert complete(fleet, "r1", member, "acme/bot").status_code == 200
    assert complete(fleet, "r2", member, "pirate").status_code == 200
    with unchanged(fleet):
        for rid in RIDS:
            response = complete(fleet, rid, member, "acme/other")
            assert response.status_code == 404
            assert shape(response, "acme/other") == shape(
                complete(fleet, rid, member, "acme/nope"), "acme/nope")
            for path, body in (("/tokenize", {"model": "acme/other", "prompt": "hi"}),
                               ("/v1/chat/completions", {"model": "acme/other", "messages": [
                                   {"role": "user", "content": "hi"}], "max_tokens": 1})):
                assert call(fleet, rid, "POST", path, member, json=body).status_code == 404
            assert call(fleet, rid, "GET", "/v1/models/acme/other", member).status_code == 404
