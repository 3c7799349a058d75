"""Tenants across a fleet, tested as an attacker would (DESIGN.md "Tenants"): two
`python -P -m loragw.gateway.server` replicas (r1, r2) on one real redis-server, the operator's key
`op-key`, and keys minted through the API for two tenants, acme and globex.

Every refused write is checked to change nothing: the catalog in Redis and the operator's view
of every adapter on both replicas are the same before and after. The tests run in order on one
fleet; near the end Redis is killed and comes back empty.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import http.client
import secrets
import threading
import time
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx
import pytest
from fleet_harness import Fleet, running_fleet, served_by
from random_adapters import write_random_adapter
from uploads import read_files

from loragw.gateway.fleet.router import FORWARDED_HEADER
from loragw.gateway.tenants.forwarding import IDENTITY_HEADER, sign

OP = "op-key"
RIDS = ("r1", "r2")
BASE = "demo-base"
PROMPT = "The quick brown fox"
MODEL_LEN = 2048  # long enough for a stream that lasts seconds on the demo model
CALLERS = 64
REVOKE_WITHIN_S = 3.0
KEY_FIELDS = {"id", "key", "tenant", "role", "adapters", "rpm", "tpm", "max_concurrency",
              "created"}
REQUEST_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                   "x-ratelimit-reset-requests")
TOKEN_HEADERS = ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens",
                 "x-ratelimit-reset-tokens")


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):
    with running_fleet(tmp_path_factory.mktemp("tenants"), model_dir, *RIDS,
                       extra=("--admin-key", OP, "--max-model-len", str(MODEL_LEN))) as fleet:
        with httpx.Client(timeout=120) as client:  # no default key: each call names its own
            fleet.client = client
            fleet.keys = {}  # name -> the mint's JSON: id, key (the secret), tenant, ...
            yield fleet


@pytest.fixture(scope="module")
def folders(hf_config, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tenant-adapters")
    return {name: write_random_adapter(str(root / name), hf_config, seed=seed)
            for seed, name in enumerate(("bot", "pirate", "other", "gbot", "evil"), start=500)}


# ---- helpers --------------------------------------------------------------------------------
def call(fleet: Fleet, rid: str, method: str, path: str, key: str | None = None,
         headers: dict | None = None, **kw) -> httpx.Response:
    sent = {"Authorization": f"Bearer {key}"} if key else {}
    sent.update(headers or {})
    return fleet.client.request(method, fleet.urls[rid] + path, headers=sent, **kw)


def raw_call(fleet: Fleet, rid: str, method: str, path: str, key: str) -> tuple[int, str]:
    """A request whose path goes out byte for byte (httpx would resolve '..')."""
    parts = urlsplit(fleet.urls[rid])
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {key}"})
        response = conn.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        conn.close()


def key(fleet: Fleet, name: str) -> str:
    return fleet.keys[name]["key"]


def mint(fleet: Fleet, rid: str, tenant: str, by: str, **body) -> httpx.Response:
    return call(fleet, rid, "POST", f"/admin/tenants/{tenant}/keys", by, json=body)


def minted(fleet: Fleet, name: str, rid: str, tenant: str, by: str, **body) -> dict:
    response = mint(fleet, rid, tenant, by, **body)
    assert response.status_code == 201, response.text
    fleet.keys[name] = response.json()
    return fleet.keys[name]


def upload(fleet: Fleet, rid: str, by: str, adapter_id: str, folder: str,
           replace: bool = False, owner: str | None = None) -> httpx.Response:
    config, weights = read_files(folder)
    data = {"adapter_id": adapter_id, "replace": str(replace).lower()}
    if owner is not None:
        data["owner"] = owner
    return call(fleet, rid, "POST", "/admin/adapters", by, data=data,
                files={"adapter_config": ("adapter_config.json", config),
                       "adapter_model": ("adapter_model.safetensors", weights)})


def complete(fleet: Fleet, rid: str, by: str | None, model: str = BASE,
             headers: dict | None = None, **extra) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **extra}
    return call(fleet, rid, "POST", "/v1/completions", by, headers=headers, json=body)


def model_ids(fleet: Fleet, rid: str, by: str) -> set[str]:
    response = call(fleet, rid, "GET", "/v1/models", by)
    assert response.status_code == 200, response.text
    return {card["id"] for card in response.json()["data"]}


def admin_ids(fleet: Fleet, rid: str, by: str) -> set[str]:
    response = call(fleet, rid, "GET", "/admin/adapters", by)
    assert response.status_code == 200, response.text
    return {info["id"] for info in response.json()["data"]}


def snapshot(fleet: Fleet) -> tuple:
    """What a refused write must leave alone: the catalog in Redis, and every adapter as the
    operator sees it on each replica."""
    views = {}
    for rid in RIDS:
        response = call(fleet, rid, "GET", "/admin/adapters", OP)
        assert response.status_code == 200, response.text
        views[rid] = {a["id"]: (a["version"], a["sha256"], a["owner"], a["pinned"])
                      for a in response.json()["data"]}
    return fleet.redis.hgetall(f"{fleet.prefix()}catalog"), views


@contextmanager
def unchanged(fleet: Fleet):
    before = snapshot(fleet)
    yield
    assert snapshot(fleet) == before


def error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    return body["error"]


def shape(response: httpx.Response, adapter_id: str) -> tuple:
    """A response as a caller can compare it, with the id it names taken out."""
    err = error(response)
    return (response.status_code, err["type"], err["code"], err["param"],
            err["message"].replace(adapter_id, "<ID>"))


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


def assert_hidden(fleet: Fleet, by: str, hidden: str, *missing: str) -> None:
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


def assert_rate_limited(response: httpx.Response, *header_groups: tuple[str, ...]) -> None:
    assert response.status_code == 429, response.text
    err = error(response)
    assert err["type"] == "rate_limit_exceeded" and err["code"] == "rate_limit_exceeded", err
    assert int(response.headers["retry-after"]) >= 1
    for group in header_groups:
        assert all(h in response.headers for h in group), (group, dict(response.headers))


def wait_until(what: str, predicate, timeout: float) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, f"timed out after {timeout} s: {what}"
        time.sleep(0.1)
    return time.monotonic() - started


async def burst(fleet: Fleet, by: str, bodies: list[dict]) -> list[httpx.Response]:
    """POST /v1/completions for every body at once, alternating r1 and r2."""
    limits = httpx.Limits(max_connections=len(bodies) + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(
            client.post(fleet.urls[RIDS[i % 2]] + "/v1/completions", json=body,
                        headers={"Authorization": f"Bearer {by}"})
            for i, body in enumerate(bodies)))


class HeldStream(threading.Thread):
    """A streamed completion that lasts seconds, held open (its client reading nothing more)
    until `release` is set; leaving it closes the connection mid-stream."""

    def __init__(self, fleet: Fleet, rid: str, by: str):
        super().__init__(daemon=True)
        self.url, self.by = fleet.urls[rid] + "/v1/completions", by
        self.status: int | None = None
        self.response: httpx.Response | None = None
        self.answered, self.release, self.closed = (threading.Event(), threading.Event(),
                                                    threading.Event())

    def run(self) -> None:
        body = {"model": BASE, "prompt": PROMPT, "max_tokens": MODEL_LEN - 64,
                "ignore_eos": True, "stream": True, "temperature": 0}
        try:
            with httpx.Client(timeout=60) as client, client.stream(
                    "POST", self.url, json=body,
                    headers={"Authorization": f"Bearer {self.by}"}) as response:
                self.status, self.response = response.status_code, response
                if response.status_code == 200:
                    # kept: an abandoned line iterator would close the connection
                    self.lines = response.iter_lines()
                    next(line for line in self.lines if line.startswith("data: "))
                else:
                    response.read()
                self.answered.set()
                self.release.wait(60)
        finally:
            self.answered.set()
            self.closed.set()

    def close(self) -> None:
        self.release.set()
        self.closed.wait(30)


def hold(fleet: Fleet, rid: str, by: str, tries: int = 10) -> HeldStream:
    """A HeldStream, answered; a refused one is retried (a finished request's slot is given
    back just after its response) up to `tries` times, 0.2 s apart."""
    for _ in range(tries):
        stream = HeldStream(fleet, rid, by)
        stream.start()
        assert stream.answered.wait(60)
        if stream.status == 200:
            return stream
        stream.close()
        time.sleep(0.2)
    return stream


# ---- 1. keys --------------------------------------------------------------------------------
def test_keys_minted_on_one_replica_are_listed_and_work_on_the_other(fleet):
    acme = minted(fleet, "acme-admin", "r1", "acme", OP, role="admin")
    assert set(acme) == KEY_FIELDS, acme
    assert acme["tenant"] == "acme" and acme["role"] == "admin" and acme["adapters"] == []
    assert acme["key"].startswith("lgw-") and acme["rpm"] is None
    member = minted(fleet, "acme-member", "r1", "acme", key(fleet, "acme-admin"),
                    role="member", adapters=["acme/bot*"])
    assert member["role"] == "member" and member["adapters"] == ["acme/bot*"]
    minted(fleet, "globex-admin", "r1", "globex", OP, role="admin")
    secrets_shown = {fleet.keys[n]["key"] for n in fleet.keys}
    assert len(secrets_shown) == 3

    # listed on r2 at once, without secrets; a tenant admin sees its own tenant's only
    listing = call(fleet, "r2", "GET", "/admin/tenants/acme/keys", OP)
    assert listing.status_code == 200, listing.text
    listed = {k["id"]: k for k in listing.json()["data"]}
    assert set(listed) == {acme["id"], member["id"]}
    for entry in listed.values():
        assert "key" not in entry and KEY_FIELDS - {"key"} <= set(entry), entry
    assert not any(s in listing.text for s in secrets_shown)
    mine = call(fleet, "r2", "GET", "/admin/tenants/acme/keys", key(fleet, "acme-admin"))
    assert {k["id"] for k in mine.json()["data"]} == set(listed)
    assert fleet.keys["globex-admin"]["id"] not in mine.text

    # every minted key works on r2 the moment it exists
    for name in ("acme-admin", "acme-member", "globex-admin"):
        assert BASE in model_ids(fleet, "r2", key(fleet, name))
    assert complete(fleet, "r2", key(fleet, "acme-member")).status_code == 200
    # ... and its use shows as last_used, on both replicas, within a heartbeat or two
    for rid in RIDS:
        wait_until(f"last_used of the member key on {rid}", lambda rid=rid: next(
            k for k in call(fleet, rid, "GET", "/admin/tenants/acme/keys", OP).json()["data"]
            if k["id"] == member["id"]).get("last_used"), timeout=4)
    # no key, or a key nobody issued: 401
    for by in (None, "lgw-" + secrets.token_urlsafe(32), "not-a-key"):
        response = call(fleet, "r2", "GET", "/v1/models", by)
        assert response.status_code == 401 and error(response)["code"] == "invalid_api_key"


# ---- 2. an adapter another tenant owns is one that does not exist ------------------------
def test_another_tenants_adapter_is_answered_like_a_missing_one(fleet, folders):
    created = upload(fleet, "r1", key(fleet, "acme-admin"), "acme/bot", folders["bot"])
    assert created.status_code == 201, created.text
    assert created.json()["owner"] == "acme"
    shared = upload(fleet, "r2", OP, "pirate", folders["pirate"])
    assert shared.status_code == 201, shared.text
    assert shared.json()["owner"] == ""
    for rid in RIDS:
        wait_until(f"{rid} to list both", lambda rid=rid: {"acme/bot", "pirate"}
                   <= model_ids(fleet, rid, OP), timeout=3)
        globex = model_ids(fleet, rid, key(fleet, "globex-admin"))
        assert {BASE, "pirate"} <= globex and "acme/bot" not in globex
        assert admin_ids(fleet, rid, key(fleet, "globex-admin")) == {"pirate"}
        assert {"acme/bot", "pirate"} <= model_ids(fleet, rid, key(fleet, "acme-member"))
        assert admin_ids(fleet, rid, key(fleet, "acme-admin")) == {"acme/bot", "pirate"}
    # the owner and the operator see it; every key may use the shared one
    assert complete(fleet, "r2", key(fleet, "acme-member"), "acme/bot").status_code == 200
    assert complete(fleet, "r1", key(fleet, "globex-admin"), "pirate").status_code == 200
    assert call(fleet, "r2", "GET", "/v1/models/acme/bot", OP).status_code == 200
    # the operator may give any id an owner: then only that tenant's keys see it
    vendor = upload(fleet, "r1", OP, "vendor", folders["other"], owner="globex")
    assert vendor.status_code == 201 and vendor.json()["owner"] == "globex", vendor.text
    for rid in RIDS:
        wait_until(f"{rid} to list vendor", lambda rid=rid: "vendor" in model_ids(
            fleet, rid, key(fleet, "globex-admin")), timeout=3)
    with unchanged(fleet):
        assert_hidden(fleet, key(fleet, "globex-admin"), "acme/bot", "globex/nope", "acme/nope")
        assert_hidden(fleet, key(fleet, "acme-admin"), "vendor", "vendor-nope")
        for rid in RIDS:  # its owner uses it, but it is not in its namespace to change
            response = call(fleet, rid, "DELETE", "/admin/adapters/vendor",
                            key(fleet, "globex-admin"))
            assert response.status_code == 403, response.text
    assert complete(fleet, "r2", key(fleet, "acme-member"), "acme/bot").status_code == 200


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


def test_paths_that_climb_out_of_a_namespace_change_nothing(fleet, folders):
    response = upload(fleet, "r2", key(fleet, "globex-admin"), "globex/bot", folders["gbot"])
    assert response.status_code == 201, response.text
    wait_until("r1 to list globex/bot", lambda: "globex/bot" in admin_ids(fleet, "r1", OP), 3)
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
                                     folders["evil"], replace=replace)
                    assert refused.status_code in (400, 403, 404), (name, adapter_id,
                                                                    refused.text)
    for rid in RIDS:  # the real ones are untouched and still served to their owners
        assert complete(fleet, rid, key(fleet, "globex-admin"), "globex/bot").status_code == 200


# ---- 4. roles --------------------------------------------------------------------------------
def test_roles_and_namespaces_are_enforced(fleet, folders):
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


# ---- 5. revocation and rotation reach the other replica -----------------------------------
def test_revocation_and_rotation_reach_the_other_replica(fleet):
    acme = key(fleet, "acme-admin")
    victim = minted(fleet, "victim", "r1", "acme", acme, role="member")
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
    old = minted(fleet, "rotated", "r1", "acme", acme, role="member")
    for rid in RIDS:
        assert complete(fleet, rid, old["key"]).status_code == 200
    grace = 2
    rotated = call(fleet, "r2", "POST", f"/admin/tenants/acme/keys/{old['id']}/rotate", acme,
                   json={"grace_seconds": grace})
    rotated_at = time.monotonic()
    assert rotated.status_code == 200, rotated.text
    new = rotated.json()
    assert new["id"] == old["id"] and new["key"] != old["key"]
    fleet.keys["rotated"] = new
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


# ---- 6. limits hold across the fleet ----------------------------------------------------------
def test_rpm_is_exact_across_replicas_under_64_callers(fleet):
    limited = minted(fleet, "rpm5", "r1", "acme", key(fleet, "acme-admin"), role="member",
                     rpm=5)
    bodies = [{"model": BASE, "prompt": PROMPT, "max_tokens": 2} for _ in range(CALLERS)]
    responses = asyncio.run(burst(fleet, limited["key"], bodies))
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert len(ok) == 5, sorted(r.status_code for r in responses)
    for response in refused:
        assert_rate_limited(response, REQUEST_HEADERS)
        assert response.headers["x-ratelimit-remaining-requests"] == "0"
        assert response.headers["x-ratelimit-limit-requests"] == "5"
        assert not any(h in response.headers for h in TOKEN_HEADERS)  # no tpm on this key
    for response in ok:
        assert all(h in response.headers for h in REQUEST_HEADERS), dict(response.headers)
    assert sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in ok) == [0, 1, 2, 3, 4]
    for rid in RIDS:  # and on its other responses too
        response = call(fleet, rid, "GET", "/v1/models", limited["key"])
        assert response.status_code == 200
        assert response.headers.get("x-ratelimit-limit-requests") == "5", dict(response.headers)
        assert_rate_limited(complete(fleet, rid, limited["key"]), REQUEST_HEADERS)


def test_concurrency_is_exact_across_replicas_under_64_callers_and_a_gone_client_frees_its_slot(
        fleet):
    limited = minted(fleet, "conc2", "r1", "acme", key(fleet, "acme-admin"), role="member",
                     max_concurrency=2)
    streams = [HeldStream(fleet, RIDS[i % 2], limited["key"]) for i in range(CALLERS)]
    try:
        for stream in streams:
            stream.start()
        for stream in streams:
            assert stream.answered.wait(60)
        admitted = [s for s in streams if s.status == 200]
        assert sorted(s.status for s in streams) == [200] * 2 + [429] * (CALLERS - 2)
        for stream in streams:
            if stream.status == 429:
                assert stream.response.json()["error"]["code"] == "rate_limit_exceeded"
                assert int(stream.response.headers["retry-after"]) >= 1
        assert_rate_limited(complete(fleet, "r1", limited["key"]))
        assert_rate_limited(complete(fleet, "r2", limited["key"]))

        admitted[0].close()  # the client goes mid-stream
        gone = time.monotonic()
        wait_until("a slot to free after the client left", lambda: complete(
            fleet, "r2", limited["key"], max_tokens=1).status_code == 200, timeout=3)
        assert time.monotonic() - gone < 3
        assert not admitted[1].closed.is_set()  # the other stream still holds its slot
        streams.append(hold(fleet, "r1", limited["key"]))  # the freed slot, taken again
        assert streams[-1].status == 200
        streams.append(hold(fleet, "r2", limited["key"], tries=1))  # and the limit holds
        assert streams[-1].status == 429
    finally:
        for stream in streams:
            stream.close()


def test_tpm_admits_exactly_what_the_reservations_predict_under_64_callers(fleet):
    tpm = 200
    limited = minted(fleet, "tpm200", "r1", "acme", key(fleet, "acme-admin"), role="member",
                     tpm=tpm)
    counted = call(fleet, "r1", "POST", "/tokenize", limited["key"],
                   json={"model": BASE, "prompt": PROMPT})
    prompt_tokens = counted.json()["count"]
    each = 60  # prompt + max_tokens reserved per request; ignore_eos: all of it is used
    body = {"model": BASE, "prompt": PROMPT, "max_tokens": each - prompt_tokens,
            "ignore_eos": True, "temperature": 0}
    responses = asyncio.run(burst(fleet, limited["key"], [body] * CALLERS))
    ok = [r for r in responses if r.status_code == 200]
    assert len(ok) == tpm // each, sorted(r.status_code for r in responses)
    for response in ok:
        assert response.json()["usage"]["total_tokens"] == each
        assert all(h in response.headers for h in TOKEN_HEADERS)
        assert not any(h in response.headers for h in REQUEST_HEADERS)  # no rpm on this key
    for response in responses:
        if response.status_code != 200:
            assert_rate_limited(response, TOKEN_HEADERS)
    left = tpm - len(ok) * each  # 20: a request reserving exactly that fits, then nothing
    fits = complete(fleet, "r2", limited["key"], max_tokens=left - prompt_tokens,
                    ignore_eos=True)
    assert fits.status_code == 200, fits.text
    assert fits.headers["x-ratelimit-remaining-tokens"] == "0"
    for rid in RIDS:
        assert_rate_limited(complete(fleet, rid, limited["key"], max_tokens=1), TOKEN_HEADERS)
    # a request that could never fit says so
    huge = complete(fleet, "r1", limited["key"], max_tokens=tpm)
    assert_rate_limited(huge, TOKEN_HEADERS)
    assert "max_tokens" in error(huge)["message"]


# ---- 7. a forwarded request is counted once ---------------------------------------------
def test_a_forwarded_request_is_served_and_counted_once(fleet):
    # acme/bot's bytes are on r1 only (no shared store): r2 forwards every request for it
    assert fleet.redis.hget(f"{fleet.prefix()}catalog", "acme/bot") is not None
    assert call(fleet, "r2", "GET", "/admin/adapters/acme/bot", OP).json()["holder"] == "r1"
    limited = minted(fleet, "fwd", "r1", "acme", key(fleet, "acme-admin"), role="member",
                     rpm=2, adapters=["acme/bot"])
    for _ in range(2):
        response = complete(fleet, "r2", limited["key"], "acme/bot")
        assert served_by(response) == "r1"
        assert all(h in response.headers for h in REQUEST_HEADERS)
    assert_rate_limited(complete(fleet, "r1", limited["key"], "acme/bot"), REQUEST_HEADERS)


def test_a_forwarded_request_over_its_limit_gets_the_429(fleet):
    response = complete(fleet, "r2", key(fleet, "fwd"), "acme/bot")
    assert_rate_limited(response, REQUEST_HEADERS)


def test_a_key_minted_a_moment_ago_is_served_through_a_forward(fleet):
    fresh = minted(fleet, "fresh", "r2", "acme", key(fleet, "acme-admin"), role="member")
    response = complete(fleet, "r2", fresh["key"], "acme/bot")
    assert response.status_code == 200, response.text
    assert served_by(response) == "r1"


# ---- 8. the forwarding headers give a client nothing ------------------------------------
def test_forged_forwarding_headers_are_refused(fleet):
    member = fleet.keys["acme-member"]
    now = int(time.time())
    forged = {IDENTITY_HEADER: f"operator.{now}.{'0' * 64}"}
    with unchanged(fleet):
        for rid in RIDS:
            for by in (None, member["key"], OP):
                assert complete(fleet, rid, by, headers=forged).status_code == 401
                for method, path, kw in (
                        ("GET", "/admin/adapters", {}), ("GET", "/v1/models", {}),
                        ("POST", "/admin/tenants/globex/keys", {"json": {"role": "admin"}}),
                        ("DELETE", "/admin/adapters/acme/bot", {}),
                        ("GET", "/admin/audit", {})):
                    response = call(fleet, rid, method, path, by, headers=forged, **kw)
                    assert response.status_code == 401, (rid, by, method, path, response.text)
            marker = {FORWARDED_HEADER: "r1"}
            assert complete(fleet, rid, None, headers=marker).status_code == 401
            assert call(fleet, rid, "GET", "/admin/adapters",
                        headers=marker).status_code == 401
            assert call(fleet, rid, "GET", "/admin/adapters", member["key"],
                        headers=marker).status_code == 403
            hidden = complete(fleet, rid, key(fleet, "globex-admin"), "acme/bot",
                              headers={**marker})
            assert hidden.status_code == 404, hidden.text

        # with the fleet's secret (whoever reads Redis has it): a signature binds the key id,
        # the method, the path, the body and the time; a revoked key stays revoked
        secret = fleet.redis.get("loragw:forward-secret")
        assert secret
        body = b'{"model": "demo-base", "prompt": "hi", "max_tokens": 1}'
        json_type = {"Content-Type": "application/json"}

        def signed(key_id: str, path: str = "/v1/completions", content: bytes = body,
                   method: str = "POST", stamp: int | None = None) -> dict:
            if stamp is None:
                return {**json_type, IDENTITY_HEADER: sign(secret, key_id, method, path,
                                                           content)}
            message = "\n".join((key_id, str(stamp), method, path,
                                 hashlib.sha256(content).hexdigest())).encode()
            mac = hmac.new(secret, message, hashlib.sha256).hexdigest()
            return {**json_type, IDENTITY_HEADER: f"{key_id}.{stamp}.{mac}"}

        def post(headers: dict, path: str = "/v1/completions", content: bytes = body) -> int:
            return call(fleet, "r2", "POST", path, headers=headers, content=content).status_code

        assert post(signed(member["id"])) == 200  # the mechanism itself works
        assert post(signed(member["id"]), content=body.replace(b"hi", b"ho")) == 401
        assert post(signed(member["id"], "/tokenize"), "/v1/completions") == 401
        assert post(signed(member["id"], method="GET")) == 401
        assert post(signed(member["id"], stamp=int(time.time()) - 600)) == 401
        assert post(signed(fleet.keys["victim"]["id"])) == 401  # revoked in test 5
        assert post(signed("key_" + "0" * 16)) == 401
        wrong = {**json_type, IDENTITY_HEADER: sign(b"x" * 64, "operator", "POST",
                                                    "/v1/completions", body)}
        assert post(wrong) == 401


# ---- 9. the audit log -------------------------------------------------------------------
def test_the_audit_log_shows_each_tenant_only_its_own(fleet):
    everything = call(fleet, "r2", "GET", "/admin/audit?limit=1000", OP)
    assert everything.status_code == 200, everything.text
    entries = everything.json()["data"]
    for entry in entries:
        assert {"time", "key_id", "tenant", "action", "adapter_id", "version",
                "sha256"} <= set(entry), entry
    times = [e["time"] for e in entries]
    assert times == sorted(times, reverse=True)
    acme_admin, globex_admin = fleet.keys["acme-admin"], fleet.keys["globex-admin"]
    created = {e["target_key_id"]: e for e in entries if e["action"] == "key.created"}
    assert created[acme_admin["id"]]["key_id"] == "operator"
    assert created[acme_admin["id"]]["tenant"] is None
    assert created[fleet.keys["acme-member"]["id"]]["key_id"] == acme_admin["id"]
    assert created[fleet.keys["acme-member"]["id"]]["tenant"] == "acme"
    uploads = {e["adapter_id"]: e for e in entries if e["action"] == "adapter.uploaded"}
    bot = call(fleet, "r1", "GET", "/admin/adapters/acme/bot", OP).json()
    assert uploads["acme/bot"]["key_id"] == acme_admin["id"]
    assert uploads["acme/bot"]["tenant"] == "acme"
    assert (uploads["acme/bot"]["version"], uploads["acme/bot"]["sha256"]) == (
        bot["version"], bot["sha256"])
    assert uploads["pirate"]["key_id"] == "operator" and uploads["pirate"]["tenant"] is None
    assert uploads["globex/bot"]["key_id"] == globex_admin["id"]
    assert any(e["action"] == "key.revoked" and e["target_key_id"] == fleet.keys["victim"]["id"]
               for e in entries)
    assert any(e["action"] == "key.rotated" for e in entries)

    for rid in RIDS:
        for tenant in ("acme", "globex"):
            mine = call(fleet, rid, "GET", "/admin/audit?limit=1000",
                        key(fleet, f"{tenant}-admin"))
            assert mine.status_code == 200, mine.text
            seen = mine.json()["data"]
            assert seen and all(tenant in (e["tenant"], e.get("owner")) for e in seen), seen
            assert seen == [e for e in entries if tenant in (e["tenant"], e.get("owner"))]
        acme_seen = call(fleet, rid, "GET", "/admin/audit?limit=1000",
                         key(fleet, "acme-admin")).json()["data"]
        assert "acme/bot" in {e["adapter_id"] for e in acme_seen}
        assert not {"pirate", "globex/bot"} & {e["adapter_id"] for e in acme_seen}
        assert globex_admin["id"] not in {e.get("target_key_id") for e in acme_seen}
        one = call(fleet, rid, "GET", "/admin/audit?limit=1", key(fleet, "acme-admin"))
        assert one.json()["data"] == acme_seen[:1]
        member = call(fleet, rid, "GET", "/admin/audit", key(fleet, "acme-member"))
        assert member.status_code == 403, member.text


# ---- 10. Redis dies, and comes back empty ------------------------------------------------
def test_keys_and_limits_outlive_a_redis_outage(fleet):
    limited = minted(fleet, "outage-rpm2", "r1", "acme", key(fleet, "acme-admin"),
                     role="member", rpm=2)
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
            assert complete(fleet, rid, fleet.keys["victim"]["key"]).status_code == 401
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
    fresh = minted(fleet, "after-outage", "r2", "globex", OP, role="member")
    assert complete(fleet, "r1", fresh["key"]).status_code == 200
    assert complete(fleet, "r1", fleet.keys["victim"]["key"]).status_code == 401


def test_a_replica_started_after_redis_came_back_empty_can_forward(fleet):
    fleet.start("r3")
    member = minted(fleet, "r3-member", "r1", "acme", key(fleet, "acme-admin"), role="member")
    call(fleet, "r3", "GET", "/admin/tenants/acme/keys", OP)  # r3 mirrors it
    response = complete(fleet, "r3", member["key"], "acme/bot")
    assert response.status_code == 200, response.text
    assert served_by(response) == "r1"
