"""Strict admin bodies, through a front end (with --admin-key) of the live gateway: no string
for a number (`"rpm": "10"`, `"weight": "1"`, `"grace_seconds": "5"`, `?limit=1e3`), limits
bounded (2^63 and 10^30 refused) with the bounds in the OpenAPI schema, and adapter globs that
compile and stay in the minted tenant's namespace; each refusal a 400 naming the field."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest

from loragw.gateway.app import create_app
from loragw.gateway.server import BackgroundServer
from loragw.gateway.tenants.minting import MAX_CONCURRENCY, MAX_RPM, MAX_TPM

KEY = "strict-admin-key"
KEYS = "/admin/tenants/strict/keys"


@pytest.fixture(scope="module")
def admin(server):
    config = replace(server.services.config, admin_key=KEY)
    with BackgroundServer(create_app(config, services=server.services)) as background, \
            httpx.Client(base_url=background.url, timeout=60,
                         headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def _refused(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


LAX_KEYS = [({"rpm": "10"}, "rpm"), ({"tpm": "10"}, "tpm"), ({"max_concurrency": "1"},
                                                               "max_concurrency"),
            ({"rpm": 1.0}, "rpm")]
LAX_KEYS += [({name: big}, name) for name in ("rpm", "tpm", "max_concurrency")
             for big in (2**63, 10**30)]
LAX_KEYS += [({"adapters": [glob]}, "adapters")
             for glob in ("../*", "[", "strict/[", "strict/[!", "other/*", "*", "strict/../x",
                          "strict/a/b", "strict/", "strict\\x", "/strict/x")]


@pytest.mark.parametrize(("fields", "param"), LAX_KEYS)
def test_a_lax_key_body_is_refused_naming_the_field(admin, fields, param):
    _refused(admin.post(KEYS, json={"role": "member", **fields}), param)


def test_strict_bodies_and_queries_still_work(admin):
    r = admin.post(KEYS, json={"role": "member", "rpm": MAX_RPM, "tpm": 10,
                               "adapters": ["strict/bot*", "strict/[ab]?", "strict/[]x]"]})
    assert r.status_code == 201, r.text
    key_id = r.json()["id"]
    _refused(admin.post(f"{KEYS}/{key_id}/rotate", json={"grace_seconds": "5"}),
             "grace_seconds")
    assert admin.post(f"{KEYS}/{key_id}/rotate", json={"grace_seconds": 5}).status_code == 200
    for limit in ("1e3", "5.0", "0x10", " 5"):
        _refused(admin.get("/admin/audit", params={"limit": limit}), "limit")
    assert admin.get("/admin/audit", params={"limit": "5"}).status_code == 200


def test_lax_alias_weights_are_refused(admin):
    for weight in ("1", 1.0, 10**30, 2**63):
        r = admin.put("/admin/aliases/strict-alias",
                      json={"targets": [{"adapter": "lora-0", "weight": weight}]})
        _refused(r, "targets[0].weight")
    assert admin.get("/admin/aliases/strict-alias").status_code == 404  # nothing stored


def test_the_schema_states_the_bounds(admin):
    schemas = admin.get("/schema/openapi.json").json()["components"]["schemas"]
    key = next(s for n, s in schemas.items() if n.endswith("CreateKey"))["properties"]
    maxima = {name: key[name].get("maximum") for name in ("rpm", "tpm", "max_concurrency")}
    assert maxima == {"rpm": MAX_RPM, "tpm": MAX_TPM, "max_concurrency": MAX_CONCURRENCY}
    target = next(s for n, s in schemas.items() if n.endswith("TargetBody"))["properties"]
    assert target["weight"].get("maximum") is not None
