"""Tenants on one replica without Redis: keys minted, listed, rotated and revoked through the
admin API and kept in a file beside the adapter store; namespaces and the 404 that hides what a
key may not use; limits held in-process with OpenAI's headers; the audit file; metrics by
tenant. The fleet (two replicas, one Redis, an attacker's tries) is test_tenants_fleet.py."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import replace

import httpx
import pytest
from litestar.testing import AsyncTestClient
from uploads import read_files

from loragw.gateway.app import create_app
from loragw.gateway.common.config import ServerConfig
from loragw.gateway.observe.metrics import Metrics
from loragw.gateway.server import BackgroundServer
from loragw.gateway.tenants.service import Tenants

OP, USER = "op-key", "user-key"
BODY = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0.0}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def tserver(model_dir, tmp_path_factory):
    config = ServerConfig(model=model_dir, served_model_name="demo-base", device="cpu",
                          max_model_len=2048, max_num_seqs=8, max_loras=4, admin_key=OP,
                          api_key=USER, adapter_dir=str(tmp_path_factory.mktemp("t-store")))
    app = create_app(config)
    with BackgroundServer(app) as background:
        background.services, background.config = app.state.services, config
        background.wait_ready()
        yield background


@pytest.fixture(scope="module")
def call(tserver):
    clients: dict[str, httpx.Client] = {}

    def client(key: str | None) -> httpx.Client:
        if key not in clients:
            clients[key] = httpx.Client(base_url=tserver.url, timeout=120,
                                        headers=bearer(key) if key else {})
        return clients[key]

    yield client
    for c in clients.values():
        c.close()


def mint(call, tenant: str, role: str, by: str = OP, **fields) -> dict:
    r = call(by).post(f"/admin/tenants/{tenant}/keys", json={"role": role, **fields})
    assert r.status_code == 201, r.text
    return r.json()


def upload(call, key: str, adapter_id: str, folder, **fields) -> httpx.Response:
    config, weights = read_files(folder)
    return call(key).post("/admin/adapters", data={"adapter_id": adapter_id, **fields},
                          files={"adapter_config": ("adapter_config.json", config),
                                 "adapter_model": ("adapter_model.safetensors", weights)})


@pytest.fixture(scope="module")
def keys(call, tserver, make_adapter, tmp_path_factory):
    folder = make_adapter(tmp_path_factory.mktemp("t-adapters") / "a", 5)
    out = {"acme": mint(call, "acme", "admin"), "globex": mint(call, "globex", "admin"),
           "member": mint(call, "acme", "member", adapters=["acme/bot*"]), "folder": folder}
    assert upload(call, out["acme"]["key"], "acme/bot", folder).status_code == 201
    assert upload(call, out["acme"]["key"], "acme/other", folder).status_code == 201
    assert upload(call, OP, "shared", folder).status_code == 201
    return out


def test_a_key_is_shown_once_and_only_its_hash_is_kept(call, keys, tserver):
    acme = keys["acme"]
    assert acme["key"].startswith("lgw-") and len(acme["key"]) > 40
    assert {acme["tenant"], acme["role"]} == {"acme", "admin"}
    listed = call(OP).get("/admin/tenants/acme/keys").json()["data"]
    assert {k["id"] for k in listed} == {acme["id"], keys["member"]["id"]}
    assert all("key" not in k for k in listed)
    assert call(acme["key"]).get("/admin/tenants/acme/keys").status_code == 200
    stored = open(os.path.join(tserver.config.adapter_path, ".tenants", "keys.json")).read()
    assert acme["key"] not in stored and keys["member"]["key"] not in stored


def test_namespaces_and_ownership(call, keys):
    acme, globex, member = keys["acme"]["key"], keys["globex"]["key"], keys["member"]["key"]
    folder = keys["folder"]
    before = call(OP).get("/admin/adapters").json()
    for key, adapter_id in ((acme, "globex/x"), (acme, "plain"), (member, "acme/bot2"),
                            (globex, "acme/bot")):
        assert upload(call, key, adapter_id, folder).status_code == 403, (key, adapter_id)
    assert upload(call, acme, "acme/bot", folder, owner="globex").status_code == 403
    assert call(acme).delete("/admin/adapters/shared").status_code == 403
    assert call(acme).post("/admin/adapters/shared/pin").status_code == 403
    assert call(OP).get("/admin/adapters").json() == before
    owners = {a["id"]: a["owner"] for a in before["data"]}
    assert owners["acme/bot"] == "acme" and owners["shared"] == ""
    cards = {m["id"]: m for m in call(OP).get("/v1/models").json()["data"]}
    assert cards["acme/bot"]["owned_by"] == "acme"


def test_what_a_key_may_not_use_does_not_exist(call, keys):
    globex, member = keys["globex"]["key"], keys["member"]["key"]
    for key, hidden, absent in ((globex, "acme/bot", "acme/nope"),
                                (member, "acme/other", "acme/nope")):
        for method, path, body in (
                ("POST", "/v1/completions", {**BODY, "model": "{}"}),
                ("POST", "/v1/chat/completions", {"model": "{}", "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "hi"}]}),
                ("POST", "/v1/responses", {"model": "{}", "input": "hi", "max_output_tokens": 2}),
                ("POST", "/tokenize", {"model": "{}", "prompt": "hi"}),
                ("GET", "/v1/models/{}", None)):
            answers = []
            for name in (hidden, absent):
                content = json.loads(json.dumps(body).replace("{}", name)) if body else None
                r = call(key).request(method, path.replace("{}", name), json=content)
                answers.append((r.status_code, r.json()["error"]["code"],
                                r.json()["error"]["message"].replace(name, "ID")))
            assert answers[0] == answers[1] and answers[0][0] == 404, (path, answers)
    acme_admin_view = {a["id"] for a in call(keys["acme"]["key"]).get("/admin/adapters")
                       .json()["data"]}
    assert acme_admin_view == {"acme/bot", "acme/other", "shared"}
    for verb in ("GET", "DELETE"):
        hidden = call(globex).request(verb, "/admin/adapters/acme/bot")
        absent = call(globex).request(verb, "/admin/adapters/globex/nope")
        assert hidden.status_code == absent.status_code == 404
    models = {m["id"] for m in call(member).get("/v1/models").json()["data"]}
    assert models == {"demo-base", "acme/bot", "shared"}
    served = call(member).post("/v1/completions", json={**BODY, "model": "acme/bot"})
    assert served.status_code == 200, served.text


def test_roles_and_the_static_keys(call, keys):
    member = keys["member"]["key"]
    for method, path in (("GET", "/admin/adapters"), ("GET", "/admin/audit"),
                         ("GET", "/admin/tenants/acme/keys"), ("DELETE", "/admin/adapters/x")):
        assert call(member).request(method, path).status_code == 403, path
    assert call(keys["acme"]["key"]).get("/admin/tenants/globex/keys").status_code == 403
    assert call(USER).get("/admin/adapters").status_code == 401  # not the admin key
    assert call(None).post("/v1/completions", json={**BODY, "model": "demo-base"}).status_code \
        == 401
    assert call("lgw-" + "x" * 43).get("/v1/models").status_code == 401
    assert call(USER).post("/v1/completions",
                           json={**BODY, "model": "acme/bot"}).status_code == 200


def test_a_tenant_admin_mints_nothing_looser_than_itself(call):
    capped = mint(call, "acme", "admin", rpm=100, adapters=["acme/bot*"])
    r = call(capped["key"]).post("/admin/tenants/acme/keys", json={"role": "member",
                                                                    "rpm": 1000})
    assert r.status_code == 403
    child = mint(call, "acme", "member", by=capped["key"])
    assert child["rpm"] == 100 and child["adapters"] == ["acme/bot*"]
    for bad in ({"role": "owner"}, {"role": "member", "rpm": 0}, {"role": "member", "x": 1}):
        assert call(OP).post("/admin/tenants/acme/keys", json=bad).status_code == 400, bad
    assert call(OP).post("/admin/tenants/Not_A_Tenant/keys",
                         json={"role": "member"}).status_code == 400


def test_rpm_limit_and_openai_headers(call):
    key = mint(call, "acme", "member", rpm=2)["key"]
    replies = [call(key).post("/v1/completions", json={**BODY, "model": "shared"})
               for _ in range(3)]
    assert [r.status_code for r in replies] == [200, 200, 429]
    assert replies[0].headers["x-ratelimit-limit-requests"] == "2"
    assert replies[1].headers["x-ratelimit-remaining-requests"] == "0"
    error = replies[2].json()["error"]
    assert error["type"] == error["code"] == "rate_limit_exceeded"
    assert int(replies[2].headers["retry-after"]) >= 1
    assert "x-ratelimit-reset-requests" in replies[2].headers
    assert "x-ratelimit-limit-requests" in call(key).get("/v1/models").headers


def test_tpm_reserves_prompt_and_max_tokens(call):
    key = mint(call, "acme", "member", tpm=40)["key"]
    prompt = call(key).post("/tokenize", json={"model": "shared", "prompt": "Hello there"})
    per_request = prompt.json()["count"] + BODY["max_tokens"]
    fits = 40 // per_request
    replies = [call(key).post("/v1/completions", json={**BODY, "model": "shared",
                                                       "ignore_eos": True})
               for _ in range(fits + 1)]
    assert [r.status_code for r in replies] == [200] * fits + [429]
    assert replies[0].headers["x-ratelimit-limit-tokens"] == "40"
    huge = call(key).post("/v1/completions", json={**BODY, "model": "shared", "max_tokens": 64})
    assert huge.status_code == 429 and "lower max_tokens" in huge.json()["error"]["message"]


async def test_a_stream_holds_its_slot_until_its_client_goes(call, tserver):
    key = mint(call, "acme", "member", max_concurrency=1)["key"]
    # Long enough that no loaded machine finishes it before the second request is admitted.
    body = {**BODY, "model": "shared", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=tserver.url, timeout=60, headers=bearer(key)) as c:
        async with c.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            # Held by name: `async for ... break` would drop the line iterator, and asyncio's
            # finalizer would then close it (and the connection) while the next request is sent.
            lines = stream.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # the stream runs; its slot is taken
            refused = await c.post("/v1/completions", json={**BODY, "model": "shared"})
            assert refused.status_code == 429, refused.text
            await lines.aclose()
        deadline = time.monotonic() + 5  # the client went away: the slot comes back
        while True:
            again = await c.post("/v1/completions", json={**BODY, "model": "shared"})
            if again.status_code == 200 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert again.status_code == 200, again.text


def test_revoke_and_rotate(call):
    key = mint(call, "globex", "member")
    assert call(key["key"]).get("/v1/models").status_code == 200
    assert call(OP).delete(f"/admin/tenants/globex/keys/{key['id']}").status_code == 200
    assert call(key["key"]).get("/v1/models").status_code == 401
    assert call(OP).delete(f"/admin/tenants/globex/keys/{key['id']}").status_code == 404
    other = mint(call, "globex", "member")
    rotated = call(OP).post(f"/admin/tenants/globex/keys/{other['id']}/rotate",
                            json={"grace_seconds": 1}).json()
    assert rotated["key"] != other["key"] and rotated["id"] == other["id"]
    assert call(rotated["key"]).get("/v1/models").status_code == 200
    assert call(other["key"]).get("/v1/models").status_code == 200  # in its grace
    time.sleep(1.2)
    assert call(other["key"]).get("/v1/models").status_code == 401
    # another tenant's key id is not found under this tenant
    assert call(OP).delete(f"/admin/tenants/acme/keys/{other['id']}").status_code == 404


async def test_keys_survive_a_restart(call, tserver):
    key = mint(call, "initech", "member")
    tenants = Tenants(tserver.config, Metrics())  # a restarted replica reading the same file
    await tenants.start()
    try:
        assert (await tenants.find(key["key"])).tenant == "initech"
        assert await tenants.find(key["key"] + "x") is None
    finally:
        await tenants.close()


def test_audit_log(call, keys):
    everything = call(OP).get("/admin/audit", params={"limit": 1000}).json()["data"]
    actions = {(e["action"], e["adapter_id"]) for e in everything}
    assert ("adapter.uploaded", "acme/bot") in actions and ("key.created", None) in actions
    upload_entry = next(e for e in everything if e["adapter_id"] == "acme/bot")
    assert upload_entry["key_id"] == keys["acme"]["id"] and upload_entry["tenant"] == "acme"
    assert len(upload_entry["sha256"]) == 64 and upload_entry["version"] >= 1
    own = call(keys["acme"]["key"]).get("/admin/audit").json()["data"]
    assert own and all("acme" in (e["tenant"], e["owner"]) for e in own)
    assert call(OP).get("/admin/audit", params={"limit": 0}).status_code == 400


def test_metrics_count_by_tenant(call):
    text = call(OP).get("/metrics").text
    assert 'loragw_tenant_requests_total{status="200",tenant="acme"}' in text
    assert 'loragw_tenant_rate_limited_total{limit="requests",tenant="acme"}' in text
    assert 'loragw_tenant_tokens_total{kind="prompt",tenant="acme"}' in text


async def test_an_open_server_mints_no_keys(tserver):
    config = replace(tserver.config, admin_key=None, api_key=None)
    async with AsyncTestClient(create_app(config, services=tserver.services)) as c:
        r = await c.post("/admin/tenants/acme/keys", json={"role": "member"})
        assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]


def test_a_tenant_registers_no_server_path_or_unlisted_source(call, keys, tserver):
    acme, before = keys["acme"]["key"], call(OP).get("/admin/adapters").json()
    stored = os.path.join(tserver.config.adapter_path, "acme", "bot")  # its own bytes, even
    for source in (stored, str(keys["folder"]), "hf://someorg/private", "s3://bucket/a/"):
        r = call(acme).post("/admin/adapters/register",
                            json={"adapter_id": "acme/copy", "source": source})
        assert r.status_code == 403, (source, r.text)
        r = call(acme).post("/v1/load_lora_adapter",
                            json={"lora_name": "acme/copy", "lora_path": source})
        assert r.status_code == 403, (source, r.text)
    assert call(OP).get("/admin/adapters").json() == before


async def test_anonymous_callers_on_an_open_v1_see_only_shared_adapters(keys, tserver):
    config = replace(tserver.config, api_key=None)  # /v1 open, the admin routes keyed
    async with AsyncTestClient(create_app(config, services=tserver.services)) as c:
        models = {m["id"] for m in (await c.get("/v1/models")).json()["data"]}
        assert "shared" in models and not any(m.startswith("acme/") for m in models)
        r = await c.post("/v1/completions", json={**BODY, "model": "acme/bot"})
        assert r.status_code == 404
        r = await c.post("/v1/completions", json={**BODY, "model": "acme/bot"},
                         headers=bearer(keys["acme"]["key"]))
        assert r.status_code == 200, r.text
        assert (await c.get("/v1/models", headers=bearer("lgw-revoked"))).status_code == 401


def test_malformed_key_requests_change_nothing(call):
    key = mint(call, "umbrella", "member")
    before = call(OP).get("/admin/tenants/umbrella/keys").json()
    base = "/admin/tenants/umbrella/keys"
    for method, path, content in (
            ("POST", base, b"{not json"), ("POST", base, b'{"role": 3}'),
            ("POST", base, b'{"role": "member", "rpm": "many"}'),
            ("POST", f"{base}/{key['id']}/rotate", b'{"grace_seconds": -1}'),
            ("POST", f"{base}/{key['id']}/rotate", b"[]")):
        r = call(OP).request(method, path, content=content,
                             headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"], (content, r.text)
    assert call(OP).get("/admin/tenants/umbrella/keys").json() == before
    assert call(key["key"]).get("/v1/models").status_code == 200  # not rotated


def test_the_placement_view_shows_a_tenant_only_its_adapters(call, keys):
    """GET /admin/placement: the operator sees every planned adapter and the replicas' loads;
    a tenant's admin key only the adapters it may use, no loads; a member key is refused."""
    for model, key in (("acme/bot", keys["acme"]["key"]), ("shared", OP)):
        r = call(key).post("/v1/completions", json={**BODY, "model": model})
        assert r.status_code == 200, r.text

    def view(key: str) -> dict:
        r = call(key).get("/admin/placement")
        assert r.status_code == 200, r.text
        return r.json()

    deadline = time.monotonic() + 10  # the next tick plans what was just served
    while not {"acme/bot", "shared"} <= {row["adapter"] for row in view(OP)["adapters"]}:
        assert time.monotonic() < deadline, view(OP)
        time.sleep(0.1)
    operator = view(OP)
    assert operator["load_tokens_per_s"] is not None
    acme = view(keys["acme"]["key"])
    assert {"acme/bot", "shared"} <= {row["adapter"] for row in acme["adapters"]}
    assert acme["load_tokens_per_s"] is None
    globex = view(keys["globex"]["key"])
    assert "acme/bot" not in {row["adapter"] for row in globex["adapters"]}
    assert call(keys["member"]["key"]).get("/admin/placement").status_code == 403
    assert call(None).get("/admin/placement").status_code == 401
