"""The admin API against a live server: upload -> use -> replace -> delete, refusals that leave
the store byte-for-byte unchanged, auth, size limit, restart, and Hub adapters on demand."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from dataclasses import replace

import httpx
import pytest
from hub_server import HubServer
from raw_http import RawRequest
from uploads import read_files

from loragw.adapters.types import TARGET_MODULES
from loragw.engine.request.params import SamplingParams
from loragw.gateway.app import create_app
from loragw.gateway.common.config import MB, ServerConfig
from loragw.gateway.observe.metrics import Metrics
from loragw.gateway.residency.manager import AdapterManager
from loragw.gateway.server import BackgroundServer

KEY = "admin-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "Tell me a story"
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


def tree_hash(root: str) -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def hub(make_adapter, tmp_path_factory):
    files = read_files(make_adapter(tmp_path_factory.mktemp("hub") / "a", 77))
    repo = {"main": {"adapter_config.json": files[0], "adapter_model.safetensors": files[1]}}
    with HubServer({"huborg/hot": repo, "other/cold": repo}) as server:
        yield server


@pytest.fixture(scope="module")
def admin_server(model_dir, hub, tmp_path_factory):
    adapter_dir = str(tmp_path_factory.mktemp("admin-store"))
    saved = {k: os.environ.get(k) for k in ("HF_ENDPOINT", "HF_HUB_CACHE")}
    os.environ["HF_ENDPOINT"] = hub.endpoint
    os.environ["HF_HUB_CACHE"] = str(tmp_path_factory.mktemp("hf-cache"))
    config = ServerConfig(model=model_dir, served_model_name="demo-base", device="cpu",
                          max_model_len=256, max_num_seqs=16, max_loras=4, admin_key=KEY,
                          adapter_dir=adapter_dir, max_upload_mb=1, hub_allow=("huborg/*",))
    app = create_app(config)
    try:
        with BackgroundServer(app) as background:
            background.services, background.adapter_dir = app.state.services, adapter_dir
            background.wait_ready()
            yield background
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def admin(admin_server):
    with httpx.Client(base_url=admin_server.url, timeout=120, headers=AUTH) as c:
        yield c


def form(adapter_id, config: bytes, weights: bytes, replace=None) -> dict:
    """The upload's multipart fields, as httpx takes them (data=, files=)."""
    data = {"adapter_id": adapter_id} | ({"replace": replace} if replace else {})
    files = {"adapter_config": ("adapter_config.json", config),
             "adapter_model": ("adapter_model.safetensors", weights)}
    return {"data": data, "files": files}


def upload(c, adapter_id, config: bytes, weights: bytes, replace=None, headers=None):
    return c.post("/admin/adapters", **form(adapter_id, config, weights, replace), headers=headers)


def complete(c, model: str) -> httpx.Response:
    return c.post("/v1/completions", json={"model": model, "prompt": PROMPT, **GREEDY})


def offline_text(offline, adapter: str | None) -> str:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return offline.generate([PROMPT], params, adapters=[adapter])[0].text


def assert_openai_error(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_upload_use_replace_delete(admin, admin_server, offline, make_adapter, tmp_path,
                                   engine_state):
    first = make_adapter(tmp_path / "v1", 11)
    r = upload(admin, "acme/story", *read_files(first))
    assert r.status_code == 201, r.text
    info = r.json()
    assert (info["id"], info["version"], info["residency"]) == ("acme/story", 1, "host")
    assert info["rank"] == 8 and info["targets"] == ["q_proj", "v_proj"]

    offline.add_adapter("acme-story", first)
    r = complete(admin, "acme/story")
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text == offline_text(offline, "acme-story") != offline_text(offline, None)
    assert admin.get("/admin/adapters/acme/story").json()["residency"] == "device"

    assert_openai_error(upload(admin, "acme/story", *read_files(first)), 409)
    second = make_adapter(tmp_path / "v2", 12)
    r = upload(admin, "acme/story", *read_files(second), replace="true")
    assert r.status_code == 201 and r.json()["version"] == 2, r.text
    offline.add_adapter("acme-story", second)
    replaced = complete(admin, "acme/story").json()["choices"][0]["text"]
    assert replaced == offline_text(offline, "acme-story") != text
    offline.remove_adapter("acme-story")

    listed = admin.get("/admin/adapters").json()["data"]
    assert [a["id"] for a in listed] == ["acme/story"]
    r = admin.delete("/admin/adapters/acme/story")
    assert r.status_code == 200 and r.json() == {"id": "acme/story", "deleted": True}
    assert_openai_error(complete(admin, "acme/story"), 404)
    assert_openai_error(admin.get("/admin/adapters/acme/story"), 404)
    # nothing left but the store's own files (dot names), in this base's store too
    assert not [p for p in tree_hash(admin_server.adapter_dir)
                if not any(part.startswith(".") for part in p.split(os.sep))]
    assert "acme/story" not in engine_state(admin_server.services).residency


def test_actions_load_evict_pin_unpin(admin, make_adapter, tmp_path):
    assert upload(admin, "acts", *read_files(make_adapter(tmp_path / "a", 3))).status_code == 201
    assert admin.post("/admin/adapters/acts/load").json()["residency"] == "device"
    pinned = admin.post("/admin/adapters/acts/pin").json()
    assert pinned["pinned"] is True
    assert_openai_error(admin.post("/admin/adapters/acts/evict"), 422)  # pinned
    assert admin.post("/admin/adapters/acts/unpin").json()["pinned"] is False
    assert admin.post("/admin/adapters/acts/evict").json()["residency"] == "disk"
    assert_openai_error(admin.post("/admin/adapters/acts/explode"), 404)
    assert_openai_error(admin.post("/admin/adapters/nope/load"), 404)
    assert admin.delete("/admin/adapters/acts").status_code == 200


def _corrupt(files: tuple[bytes, bytes], kind: str) -> tuple[str, bytes, bytes, int]:
    config, weights = files
    cfg = json.loads(config)
    if kind == "bad-json":
        return "bad", b"{not json", weights, 422
    if kind == "truncated":
        return "bad", config, weights[: len(weights) // 2], 422
    if kind == "lying-header":
        return "bad", config, (10**9).to_bytes(8, "little") + weights[8:], 422
    if kind == "wrong-shape":
        from safetensors.torch import load as st_load
        from safetensors.torch import save as st_save
        tensors = st_load(weights)
        key = next(iter(tensors))
        tensors[key] = tensors[key][:, :-1].contiguous()
        return "bad", config, st_save(tensors), 422
    if kind == "unknown-target":
        return "bad", json.dumps(cfg | {"target_modules": ["nonexistent_proj"]}).encode(), \
            weights, 422
    if kind == "rank-too-large":
        return "bad", json.dumps(cfg | {"r": 4096}).encode(), weights, 422
    if kind == "seq-cls":  # a classifier's LoRA: its head is not served
        return "bad", json.dumps(cfg | {"task_type": "SEQ_CLS"}).encode(), weights, 422
    if kind == "pickle":
        return "bad", config, b"\x80\x04\x95" + b"\x00" * 64, 422
    if kind == "dotdot":
        return "..", config, weights, 400
    if kind == "slash-abuse":
        return "a/b/c", config, weights, 400
    if kind == "leading-slash":
        return "/etc", config, weights, 400
    if kind == "control-char":
        return "bad\nid", config, weights, 400
    if kind == "base-name":
        return "demo-base", config, weights, 400
    raise AssertionError(kind)


MALFORMED = ["bad-json", "truncated", "lying-header", "wrong-shape", "unknown-target",
             "rank-too-large", "seq-cls", "pickle", "dotdot", "slash-abuse", "leading-slash",
             "control-char", "base-name"]


@pytest.mark.parametrize("kind", MALFORMED)
def test_malformed_uploads_leave_the_store_unchanged(kind, admin, admin_server, make_adapter,
                                                     tmp_path):
    files = read_files(make_adapter(tmp_path / "a", 5))
    assert upload(admin, "keeper", *files, replace="true").status_code == 201
    before = tree_hash(admin_server.adapter_dir)
    adapter_id, config, weights, status = _corrupt(files, kind)
    assert_openai_error(upload(admin, adapter_id, config, weights), status)
    assert tree_hash(admin_server.adapter_dir) == before


def test_oversize_missing_fields_and_auth_are_refused(admin, admin_server, make_adapter,
                                                      tmp_path):
    files = read_files(make_adapter(tmp_path / "a", 6))
    before = tree_hash(admin_server.adapter_dir)
    assert_openai_error(upload(admin, "big", files[0], b"\0" * (3 * MB // 2)), 413)
    assert_openai_error(admin.post("/admin/adapters", data={"adapter_id": "x"},
                                   files={"adapter_config": ("c", files[0])}), 400)
    no_key = {"Authorization": ""}
    assert_openai_error(upload(admin, "anon", *files, headers=no_key), 401)
    assert_openai_error(upload(admin, "anon", *files, headers={"Authorization": "Bearer no"}),
                        401)
    assert_openai_error(admin.get("/admin/adapters", headers=no_key), 401)
    assert tree_hash(admin_server.adapter_dir) == before


@pytest.fixture(scope="module")
def limits_server(admin_server):
    """A second front end on the admin server's engine and store, with --max-request-mb 1,
    --max-upload-mb 4 and --upload-timeout-s 0.5."""
    config = replace(admin_server.services.config, max_request_mb=1, max_upload_mb=4,
                     upload_timeout_s=0.5)
    with BackgroundServer(create_app(config, services=admin_server.services)) as background:
        yield background


def raw_upload(url: str, adapter_id: str, files: tuple[bytes, bytes]) -> tuple[RawRequest, bytes]:
    """An upload's request line and headers sent by hand; its body, for the test to send."""
    built = httpx.Request("POST", url, **form(adapter_id, *files))
    body = built.read()
    headers = {**AUTH, "Content-Type": built.headers["content-type"],
               "Content-Length": str(len(body))}
    return RawRequest(url, "POST", "/admin/adapters", headers), body


def test_an_upload_between_max_request_mb_and_max_upload_mb_is_stored(limits_server,
                                                                     make_adapter, tmp_path):
    files = read_files(make_adapter(tmp_path / "big", 31, rank=16, targets=TARGET_MODULES))
    assert 1 * MB < sum(map(len, files)) < 4 * MB
    with httpx.Client(base_url=limits_server.url, timeout=120, headers=AUTH) as c:
        r = upload(c, "big", *files)
        assert r.status_code == 201, r.text
        assert c.delete("/admin/adapters/big").status_code == 200


def test_an_upload_past_max_upload_mb_is_a_413_naming_the_flag(limits_server, admin_server):
    before = tree_hash(admin_server.adapter_dir)
    multipart = {**AUTH, "Content-Type": "multipart/form-data; boundary=x"}
    declared = {**multipart, "Content-Length": str(4 * MB + 1)}
    chunked = {**multipart, "Transfer-Encoding": "chunked"}
    for headers in (declared, chunked):
        with RawRequest(limits_server.url, "POST", "/admin/adapters", headers) as r:
            if headers is chunked:  # no length: refused once 4 MB have come
                all(r.send_chunk(b"\0" * MB) for _ in range(5))
            status, body = r.response()
        assert status == 413, body
        assert body["error"]["code"] == "request_too_large"
        assert "larger than --max-upload-mb 4 MB" in body["error"]["message"], body
    assert tree_hash(admin_server.adapter_dir) == before


def test_an_upload_that_stalls_is_cut_off_with_a_408_and_nothing_stored(
        limits_server, admin_server, make_adapter, tmp_path):
    files = read_files(make_adapter(tmp_path / "a", 32))
    before = tree_hash(admin_server.adapter_dir)
    request, body = raw_upload(limits_server.url, "stalled", files)
    with request:
        request.send(body[: len(body) // 2])  # then nothing
        started = time.monotonic()
        status, error = request.response()
    assert status == 408, error
    assert error["error"]["code"] == "request_timeout"
    assert "--upload-timeout-s 0.5 s" in error["error"]["message"], error
    assert 0.4 < time.monotonic() - started < 10
    assert tree_hash(admin_server.adapter_dir) == before
    # an upload that pauses, but never for that long, is stored
    request, body = raw_upload(limits_server.url, "slow", files)
    with request:
        third = len(body) // 3
        for piece in (body[:third], body[third:2 * third], body[2 * third:]):
            request.send(piece)
            time.sleep(0.3)
        status, info = request.response()
    assert status == 201, info
    with httpx.Client(base_url=limits_server.url, timeout=120, headers=AUTH) as c:
        assert c.delete("/admin/adapters/slow").status_code == 200


async def test_restart_knows_stored_adapters(admin, admin_server, make_adapter, tmp_path):
    assert upload(admin, "survivor", *read_files(make_adapter(tmp_path / "a", 8)),
                  replace="true").status_code == 201
    services = admin_server.services
    config = ServerConfig(model=services.config.model, adapter_dir=admin_server.adapter_dir,
                          replica_id="restarted", served_model_name="demo-base")
    again = AdapterManager(config, services.engine, Metrics())
    await again.start()
    try:
        assert "survivor" in again.records
        info = await again.get("survivor")
        assert info.version >= 1 and info.source == "upload"
    finally:
        await again.close()


async def test_hub_adapter_fetched_once_on_demand(admin_server, hub):
    async with httpx.AsyncClient(base_url=admin_server.url, timeout=120) as c:
        body = {"model": "huborg/hot", "prompt": PROMPT, **GREEDY}
        replies = await asyncio.gather(*(c.post("/v1/completions", json=body)
                                         for _ in range(8)))
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        assert len({r.json()["choices"][0]["text"] for r in replies}) == 1
        assert hub.downloads("huborg/hot", "adapter_model.safetensors") == 1
        r = await c.post("/v1/completions", json=body | {"model": "other/cold"})
        assert_openai_error(r, 404)
        assert "other/cold" in r.json()["error"]["message"]


def test_an_adapter_for_another_base_is_refused_or_flagged(admin, admin_server, make_adapter,
                                                           tmp_path):
    """adapter_config.json names the base it was trained on: another architecture class is a
    422 that stores nothing; only another name (a Hub id for this local model, say) is served,
    with the warning in the adapter's admin info."""
    config, weights = read_files(make_adapter(tmp_path / "a", 21))
    named = json.loads(config)
    other_class = {**named, "auto_mapping": {"base_model_class": "Qwen2ForCausalLM"}}
    before = tree_hash(admin_server.adapter_dir)
    r = upload(admin, "wrong-base", json.dumps(other_class).encode(), weights)
    assert_openai_error(r, 422)
    assert "Qwen2ForCausalLM" in r.json()["error"]["message"]
    assert tree_hash(admin_server.adapter_dir) == before
    other_name = {**named, "base_model_name_or_path": "meta-llama/Llama-3.1-8B"}
    r = upload(admin, "other-name", json.dumps(other_name).encode(), weights)
    assert r.status_code == 201, r.text
    (warning,) = r.json()["warnings"]
    assert "meta-llama/Llama-3.1-8B" in warning
    assert admin.get("/admin/adapters/other-name").json()["warnings"] == [warning]
    assert admin.delete("/admin/adapters/other-name").status_code == 200
