"""What an operator and a misbehaving client see: probes, metrics, request ids, errors in
OpenAI's shape, keys, backpressure, disconnects that free their sequences, and a fuzz run
over the OpenAPI schema that must never produce a 5xx."""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from litestar.testing import AsyncTestClient, TestClient
from prometheus_client.parser import text_string_to_metric_families
from raw_http import RawRequest

from loragw.gateway.app import create_app
from loragw.gateway.common.config import MB, ServerConfig
from loragw.gateway.common.flags import add_options
from loragw.gateway.server import BackgroundServer, serve_main
from loragw.gateway.services import Services

BASE = "demo-base"  # conftest's served model name
ADAPTER = "lora-0"
SMALL = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


def test_probes_and_metrics(http, base_name):
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/ready").json() == {"status": "ready"}
    for model in (base_name, ADAPTER):
        body = {"model": model, "prompt": "hi", **SMALL}
        assert http.post("/v1/completions", json=body).status_code == 200
    http.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for line in (f'loragw_requests_total{{adapter="{ADAPTER}",status="200",version="',
                 'loragw_requests_total{adapter="base",status="200",version=""}',
                 f'loragw_completion_tokens_total{{adapter="{ADAPTER}",version="',
                 f'loragw_prompt_tokens_total{{adapter="{ADAPTER}",version="',
                 f'loragw_time_to_first_token_seconds_count{{adapter="{ADAPTER}",version="',
                 f'loragw_time_per_output_token_seconds_count{{adapter="{ADAPTER}",version="',
                 f'loragw_e2e_request_latency_seconds_count{{adapter="{ADAPTER}",version="',
                 'loragw_http_requests_total{route="/v1/completions",status="404"}',
                 "loragw_kv_blocks_total ", "loragw_kv_blocks_used ",
                 "loragw_num_requests_running ", "loragw_num_requests_waiting ",
                 "loragw_lora_slots_used ", "loragw_lora_slots_total 4.0",
                 'loragw_adapter_loads_total{tier="device"}',
                 'loragw_adapter_evictions_total{tier="device"}',
                 'loragw_adapter_hits_total{tier="device"}',
                 'loragw_lora_device_bytes{pool="projections"}',
                 'loragw_model_parameters{kind="total"}',
                 'loragw_model_parameters{kind="active"}'):
        assert line in text, f"{line!r} missing from /metrics"
    assert 'adapter="nope"' not in text  # unknown names never become label values


def test_request_ids_are_echoed_or_generated(http):
    assert http.get("/health", headers={"X-Request-Id": "abc-123"}).headers["x-request-id"] \
        == "abc-123"
    generated = http.get("/health").headers["x-request-id"]
    assert len(generated) == 32
    assert http.get("/no/such/route").headers["x-request-id"]
    r = http.post("/v1/completions", content=b"{", headers={"X-Request-Id": "bad json"})
    assert r.status_code == 400 and r.headers["x-request-id"] != "bad json"  # spaces refused


def test_bad_requests_get_4xx_in_openai_shape_and_the_server_keeps_serving(http, base_name):
    error = assert_openai_error(http.post("/v1/completions", json={
        "model": "no-such-adapter", "prompt": "hi"}), 404, "model_not_found")
    assert "no-such-adapter" in error["message"] and error["param"] == "model"
    error = assert_openai_error(http.post("/v1/completions", json={
        "model": base_name, "prompt": [1] * 600, "max_tokens": 10}), 400,
        "context_length_exceeded")
    assert "512" in error["message"] and "600" in error["message"]
    long_text = "the ocean is wide " * 1200  # long enough to be tokenized off the event loop
    error = assert_openai_error(http.post("/v1/chat/completions", json={
        "model": base_name, "messages": [{"role": "user", "content": long_text}]}), 400,
        "context_length_exceeded")
    assert "512" in error["message"] and error["param"] == "prompt"
    error = assert_openai_error(http.post("/v1/chat/completions", json={
        "model": base_name, "messages": [{"role": "user", "content": "hi"}], "top_p": 2}), 400)
    assert error["param"] == "top_p"
    assert_openai_error(http.post("/v1/completions", content=b'{"model": ',
                                  headers={"content-type": "application/json"}), 400)
    assert_openai_error(http.post("/v1/completions", json={"prompt": "no model"}), 400)
    assert_openai_error(http.post("/v1/completions", json={
        "model": base_name, "prompt": ["mixed", 1]}), 400)
    assert_openai_error(http.post("/v1/completions", json={
        "model": base_name, "prompt": [10**7]}), 400)
    assert_openai_error(http.post("/v1/completions", content=b" " * (33 * MB),
                                  headers={"content-type": "application/json"}), 413)
    assert_openai_error(http.get("/v1/completions"), 405)
    assert_openai_error(http.get("/v1/nothing-here"), 404)
    r = http.post("/v1/completions", json={"model": base_name, "prompt": "hi", **SMALL})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


HUGE_NAME = "m" * 200_000  # a client's model name, echoed back only cut short
HUGE_PATH_NAME = "m" * 50_000  # in a URL: httpx sends at most 64 KB of one


@pytest.mark.parametrize(("method", "path", "body", "status"), [
    ("POST", "/v1/completions", {"model": HUGE_NAME, "prompt": "hi"}, 404),
    ("POST", "/v1/chat/completions", {"model": HUGE_NAME, "messages": [
        {"role": "user", "content": "hi"}]}, 404),
    ("POST", "/v1/responses", {"model": HUGE_NAME, "input": "hi"}, 404),
    ("POST", "/tokenize", {"model": HUGE_NAME, "prompt": "hi"}, 404),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": HUGE_NAME}, 404),
    ("POST", "/v1/load_lora_adapter", {"lora_name": HUGE_NAME, "lora_path": "/nowhere"}, 400),
    ("GET", f"/v1/models/{HUGE_PATH_NAME}", None, 404),
    ("GET", f"/admin/adapters/{HUGE_PATH_NAME}", None, 400),
])
def test_a_huge_model_name_is_echoed_cut_short(server, method, path, body, status):
    r = httpx.request(method, server.url + path, json=body, timeout=60)
    error = assert_openai_error(r, status)
    assert len(r.content) < 1024, r.content[:300]
    length = len(HUGE_NAME if body else HUGE_PATH_NAME)
    assert f"'{'m' * 64}'... ({length} characters)" in error["message"], error["message"]


JSON_BODIES = {"/v1/completions": {"model": BASE, "prompt": "hi", **SMALL},
               "/v1/chat/completions": {"model": BASE, "messages": [
                   {"role": "user", "content": "hi"}], **SMALL},
               "/v1/responses": {"model": BASE, "input": "hi", "max_output_tokens": 2},
               "/tokenize": {"model": BASE, "prompt": "hi"}}


@pytest.fixture(scope="module")
def one_mb_server(server, server_config):
    """A second front end on the live engine with --max-request-mb 1."""
    app = create_app(replace(server_config, max_request_mb=1), services=server.services)
    with BackgroundServer(app) as background:
        yield background


def assert_too_large(status: int, body: dict) -> None:
    assert status == 413, body
    error = body["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert "larger than --max-request-mb 1 MB" in error["message"], error


@pytest.mark.parametrize("path", list(JSON_BODIES))
def test_a_json_body_over_max_request_mb_is_a_413_naming_the_flag(one_mb_server, path):
    json_type = {"Content-Type": "application/json"}
    declared = {**json_type, "Content-Length": str(MB + 1)}
    with RawRequest(one_mb_server.url, "POST", path, declared) as r:  # refused unread
        assert_too_large(*r.response())
    chunked = {**json_type, "Transfer-Encoding": "chunked"}
    with RawRequest(one_mb_server.url, "POST", path, chunked) as r:  # no length: counted
        chunk = b" " * (64 * 1024)
        sent = 0
        while sent <= MB and r.send_chunk(chunk):
            sent += len(chunk)
        assert_too_large(*r.response())
    under = httpx.post(one_mb_server.url + path, json=JSON_BODIES[path], timeout=60)
    assert under.status_code == 200, under.text


@pytest.mark.parametrize("field", [
    {"response_format": {"type": "yaml"}},
    {"tool_choice": "required"},  # without tools
    {"logit_bias": {"5": 101.0}},  # out of [-100, 100]
    {"top_logprobs": 2},
])
def test_unimplemented_chat_fields_are_refused(http, field):
    body = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], **SMALL, **field}
    assert_openai_error(http.post("/v1/chat/completions", json=body), 400)


def test_trivial_values_of_unimplemented_fields_are_accepted(http):
    body = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], **SMALL,
            "response_format": {"type": "text"}, "tool_choice": "none", "user": "u1",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    echo = {"model": BASE, "prompt": "hi", **SMALL, "echo": True, "logprobs": 1}
    logprobs = http.post("/v1/completions", json=echo).json()["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"][0] is None  # the prompt's (test_prompt_logprobs_api.py)


async def test_keys_guard_v1_and_admin_routes_but_not_probes(server, server_config):
    config = replace(server_config, api_key="user-key", admin_key="admin-key")
    app = create_app(config, services=server.services)
    user = {"Authorization": "Bearer user-key"}
    admin = {"Authorization": "Bearer admin-key"}
    body = {"model": BASE, "prompt": "hi", **SMALL}
    async with AsyncTestClient(app) as c:
        assert_openai_error(await c.post("/v1/completions", json=body), 401, "invalid_api_key")
        wrong = await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer x"})
        assert_openai_error(wrong, 401, "invalid_api_key")
        # the key is checked before the body is parsed
        assert_openai_error(await c.post("/v1/completions", content=b"{"), 401)
        assert (await c.post("/v1/completions", json=body, headers=user)).status_code == 200
        assert (await c.get("/v1/models", headers=user)).status_code == 200
        unload = {"lora_name": "never-loaded"}
        r = await c.post("/v1/unload_lora_adapter", json=unload, headers=user)
        assert_openai_error(r, 401)  # the user key is not the admin key
        r = await c.post("/v1/unload_lora_adapter", json=unload, headers=admin)
        assert_openai_error(r, 404)
        for path in ("/health", "/ready", "/metrics"):
            assert (await c.get(path)).status_code == 200


KEYS = {"api_key": "user-key", "admin_key": "admin-key", "metrics_key": "metrics-key"}
GUARDED = [  # method, path, body, the key the route takes, the status with that key
    ("GET", "/v1/models", None, "api_key", 200),
    ("POST", "/v1/completions", {"model": BASE, "prompt": "hi", **SMALL}, "api_key", 200),
    ("POST", "/v1/chat/completions", {"model": BASE, "messages": [
        {"role": "user", "content": "hi"}], **SMALL}, "api_key", 200),
    ("POST", "/v1/responses", {"model": BASE, "input": "hi", "max_output_tokens": 2},
     "api_key", 200),
    ("POST", "/tokenize", {"model": BASE, "prompt": "hi"}, "api_key", 200),
    ("POST", "/detokenize", {"model": BASE, "tokens": [1]}, "api_key", 200),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "never-loaded",
                                       "lora_path": "/nonexistent"}, "admin_key", 404),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, "admin_key", 404),
    ("GET", "/admin/adapters", None, "admin_key", 200),
    ("GET", "/metrics", None, "metrics_key", 200),
]


async def test_the_bearer_scheme_is_case_insensitive_on_every_guarded_route(server,
                                                                           server_config):
    app = create_app(replace(server_config, **KEYS), services=server.services)
    async with AsyncTestClient(app) as c:
        for method, path, body, key, status in GUARDED:
            for scheme in ("Bearer", "bearer", "BEARER"):
                right = await c.request(method, path, json=body,
                                        headers={"Authorization": f"{scheme} {KEYS[key]}"})
                assert right.status_code == status, (scheme, path, right.text)
                wrong = await c.request(method, path, json=body,
                                        headers={"Authorization": f"{scheme} wrong-key"})
                assert_openai_error(wrong, 401, "invalid_api_key")


async def test_metrics_take_the_metrics_key_once_one_is_set(server, server_config):
    app = create_app(replace(server_config, metrics_key="metrics-key"), services=server.services)
    async with AsyncTestClient(app) as c:
        error = assert_openai_error(await c.get("/metrics"), 401, "invalid_api_key")
        assert "metrics key" in error["message"]
        other = await c.get("/metrics", headers={"Authorization": "Bearer user-key"})
        assert "metrics key" in assert_openai_error(other, 401, "invalid_api_key")["message"]
        scraped = await c.get("/metrics", headers={"Authorization": "Bearer metrics-key"})
        assert scraped.status_code == 200 and "loragw_http_requests_total" in scraped.text
        for path in ("/health", "/ready"):  # probes never take a key
            assert (await c.get(path)).status_code == 200


def test_an_unexpected_failure_is_a_logged_500_naming_the_request_id(http, server,
                                                                    monkeypatch, caplog):
    def broken(*_):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(server.services.adapters, "resident_on", broken)  # /v1/models reads it
    r = http.get("/v1/models", headers={"X-Request-Id": "req-500"})
    error = assert_openai_error(r, 500, "internal_error")
    assert "req-500" in error["message"] and error["type"] == "server_error"
    assert "simulated bug" not in error["message"]  # details go to the log, not the client
    assert any("req-500" in rec.getMessage() and rec.exc_info for rec in caplog.records)
    monkeypatch.undo()
    assert http.get("/v1/models").status_code == 200


def test_a_full_server_answers_429_with_retry_after(http, server):
    services = server.services
    services.capacity.inflight += services.config.max_capacity  # as if every slot and queue place were taken
    try:
        r = http.post("/v1/completions", json={"model": BASE, "prompt": "hi", **SMALL})
        assert_openai_error(r, 429, "rate_limit_exceeded")
        assert int(r.headers["retry-after"]) >= 1
    finally:
        services.capacity.inflight -= services.config.max_capacity
    too_many = {"model": BASE, "prompt": ["a"] * 100, "n": 10, **SMALL}
    assert_openai_error(http.post("/v1/completions", json=too_many), 400)
    assert http.post("/v1/completions", json={"model": BASE, "prompt": "hi",
                                              **SMALL}).status_code == 200


def metric(http, name: str, **labels) -> float:
    """One sample from /metrics (0 when absent)."""
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


LONG = 480  # tokens a request would generate if nobody stopped it (context 512)


@pytest.mark.parametrize("n", [1, 2])
def test_a_client_disconnecting_mid_stream_frees_its_sequences(server, http, wait_idle, n,
                                                               engine_state):
    services, adapter = server.services, "lora-6"
    finished = metric(http, "loragw_e2e_request_latency_seconds_count", adapter=adapter)
    generated = metric(http, "loragw_completion_tokens_total", adapter=adapter)
    counted = {status: (metric(http, "loragw_requests_total", adapter=adapter, status=status),
                        metric(http, "loragw_http_requests_total", route="/v1/completions",
                               status=status)) for status in ("200", "499")}
    body = {"model": adapter, "prompt": "tell me a long story", "max_tokens": LONG,
            "temperature": 0, "ignore_eos": True, "stream": True, "n": n}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert sum(next(lines).startswith("data: {") for _ in range(6)) >= 3
            snap = engine_state(services)
            assert snap.num_running + snap.num_waiting == n  # every choice still generating
    # closed with the response unread: the server must abort every choice, not finish them
    wait_idle(services, timeout=20)
    snap = engine_state(services)
    assert snap.kv_blocks_free == snap.kv_blocks_total
    assert snap.slots_in_use == 0 and services.capacity.inflight == 0
    assert metric(http, "loragw_e2e_request_latency_seconds_count", adapter=adapter) == finished
    assert metric(http, "loragw_completion_tokens_total", adapter=adapter) - generated < n * LONG
    # counted as abandoned (499, as a whole response given up), not as the 200 its headers said
    deadline = time.monotonic() + 10
    while metric(http, "loragw_requests_total", adapter=adapter, status="499") == \
            counted["499"][0]:
        assert time.monotonic() < deadline, "the abandoned stream was never counted"
        time.sleep(0.05)
    assert (metric(http, "loragw_requests_total", adapter=adapter, status="499"),
            metric(http, "loragw_http_requests_total", route="/v1/completions", status="499")) \
        == (counted["499"][0] + 1, counted["499"][1] + 1)
    assert metric(http, "loragw_requests_total", adapter=adapter, status="200") == \
        counted["200"][0]


def test_a_client_giving_up_on_a_whole_response_frees_its_sequence(server, http, wait_idle):
    adapter = "lora-7"
    finished = metric(http, "loragw_e2e_request_latency_seconds_count", adapter=adapter)
    body = {"model": adapter, "prompt": "tell me a long story", "max_tokens": LONG,
            "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    wait_idle(server.services, timeout=20)
    assert metric(http, "loragw_e2e_request_latency_seconds_count", adapter=adapter) == finished
    assert metric(http, "loragw_http_requests_total", route="/v1/completions", status="499") >= 1


def test_not_ready_answers_503_but_health_is_200(server_config):
    idle = Services(server_config)  # never started: the model is "loading"
    with TestClient(create_app(server_config, services=idle)) as c:
        assert c.get("/health").status_code == 200
        assert_openai_error(c.get("/ready"), 503, "not_ready")
        r = c.post("/v1/completions", json={"model": BASE, "prompt": "hi"})
        assert_openai_error(r, 503)
        assert r.headers["retry-after"]
        assert c.get("/metrics").status_code == 200


def serve_config(argv: list[str], environ: dict[str, str]) -> ServerConfig:
    """`loragw serve ARGV` with exactly `environ` as its LORAGW_* environment."""
    parser = add_options(argparse.ArgumentParser(), ServerConfig, environ)
    return ServerConfig.from_args(parser.parse_args(argv))


def test_config_reads_flags_then_environment(tmp_path, capsys):
    env = {"LORAGW_MAX_LORAS": "7", "LORAGW_API_KEY": "k", "LORAGW_HUB_ALLOW": "org/*, x/y",
           "LORAGW_ADAPTER": "a=/p/a,b=/p/b", "LORAGW_PORT": "9000"}
    config = serve_config(["--model", str(tmp_path), "--port", "8123", "--adapter", "c=/p/c"],
                          env)
    assert (config.port, config.max_loras, config.api_key) == (8123, 7, "k")
    assert config.hub_allow == ("org/*", "x/y") and config.adapter == ("c=/p/c",)
    assert config.model_name == tmp_path.name and config.max_upload_mb == 512
    demo = serve_config([], {"LORAGW_DEMO": "1", "LORAGW_API_KEY": ""})
    assert demo.api_key is None  # an empty variable is no key, not an empty key
    assert demo.demo and demo.model_name == "demo"
    with pytest.raises(SystemExit):  # a usage error naming the variable
        serve_config(["--demo"], {"LORAGW_MAX_LORAS": "x"})
    assert "LORAGW_MAX_LORAS" in capsys.readouterr().err
    with pytest.raises(ValueError, match="NAME=SOURCE"):
        ServerConfig(model=str(tmp_path), adapter=("no-equals-sign",))
    assert serve_main(["--model", str(tmp_path / "missing")]) == 2


def test_full_module_slots_flag_reaches_the_engine(tmp_path):
    """Saved modules (modules_to_save) are opt-in: off by default, on with the flag or env."""
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    off = serve_config(["--model", str(tmp_path)], {})
    assert off.engine_options()["max_full_module_slots"] == 0
    on = serve_config(["--model", str(tmp_path), "--max-full-module-slots", "2"], {})
    assert on.engine_options()["max_full_module_slots"] == 2
    env = serve_config(["--model", str(tmp_path)], {"LORAGW_MAX_FULL_MODULE_SLOTS": "1"})
    assert env.max_full_module_slots == 1
    with pytest.raises(ValueError, match=r"--max-full-module-slots must be in \[0, --max-loras=4\]"):
        ServerConfig(model=str(tmp_path), max_loras=4, max_full_module_slots=5)


def test_serve_exits_nonzero_when_start_up_fails(model_dir, tmp_path):
    broken = tmp_path / "no-weights"
    broken.mkdir()
    (broken / "config.json").write_bytes((Path(model_dir) / "config.json").read_bytes())
    # its own adapter store: the default one is `make demo`'s and every other local run's
    common = ["--port", "0", "--device", "cpu", "--adapter-dir", str(tmp_path / "store")]
    assert serve_main(["--model", str(broken), *common]) == 1
    bad_adapter = ["--model", model_dir, *common, "--adapter", f"x={tmp_path / 'nothing-here'}"]
    assert serve_main(bad_adapter) == 1


# ---- fuzzing from the OpenAPI schema ---------------------------------------------------------
FUZZ_CASES = 200
# Values drawn for these keys whatever the schema says: mostly valid, and every generation short.
BOUNDED = {"max_tokens": [1, 2, 3, 4] * 3 + [0, -1, 10**9, "x"],
           "max_completion_tokens": [1, 2, 3, 0, 10**9], "n": [1] * 6 + [2, 3, 0, 10**6],
           "max_output_tokens": [1, 2, 3, 4] * 3 + [0, -1, 10**9, "x"],  # /v1/responses
           "model": [BASE, ADAPTER, "lora-1", "unknown/model"], "stream": [True, False],
           # never an adapter the other tests use, never a path that exists, never the Hub
           # (a Hub source the server cannot reach is an honest 502)
           "lora_name": ["fuzz-a", "x", "", "../etc", "a/b/c", BASE],
           "lora_path": ["/nonexistent", "", "/etc/passwd", "./relative", "file:///nope"]}


# an absent max_tokens means "the rest of the context": too slow here
ALWAYS = {"max_tokens", "max_output_tokens"}


class SchemaFuzzer:
    """Random JSON bodies from the app's own OpenAPI request schemas, mostly valid, some
    mutated (wrong types, out-of-range numbers, missing fields, stray fields)."""

    def __init__(self, spec: dict, seed: int):
        self.spec, self.rng = spec, random.Random(seed)

    def body(self, schema: dict):
        value = self.value(schema, depth=0)
        if isinstance(value, dict) and self.rng.random() < 0.2:
            self.mutate(value)
        return value

    def resolve(self, schema: dict) -> dict:
        while "$ref" in schema:
            schema = self.spec["components"]["schemas"][schema["$ref"].split("/")[-1]]
        return schema

    def value(self, schema: dict, depth: int, key: str = ""):
        rng, schema = self.rng, self.resolve(schema)
        if key in BOUNDED:
            return rng.choice(BOUNDED[key])
        for combo in ("oneOf", "anyOf"):
            if combo in schema:  # Litestar puts an Optional field's bounds beside its oneOf
                outer = {k: v for k, v in schema.items() if k != combo}
                return self.value({**outer, **self.resolve(rng.choice(schema[combo]))}, depth,
                                  key)
        if "enum" in schema:
            return rng.choice(schema["enum"])
        if "const" in schema:
            return schema["const"]
        kind = schema.get("type", "object")
        if isinstance(kind, list):
            kind = rng.choice(kind)
        if kind == "object" or "properties" in schema:
            props = schema.get("properties", {})
            required = set(schema.get("required", []))
            return {k: self.value(s, depth + 1, k) for k, s in props.items()
                    if k in required or k in ALWAYS or (depth < 3 and rng.random() < 0.25)}
        if kind == "array":
            lo, hi = schema.get("minItems", 0), min(schema.get("maxItems", 3), 3)
            count = rng.randint(lo, max(lo, hi)) if depth < 4 else lo
            return [self.value(schema.get("items", {}), depth + 1) for _ in range(count)]
        if kind == "string":
            return rng.choice(["", "hi", "Tell me a story", "\u00e9\u2603\U0001f600", "a" * 50,
                               "<|im_end|>"])
        if kind in ("integer", "number"):  # the bounds themselves, and a value inside them
            # Litestar drops a bound of 0 on Optional fields, so no lower bound reads as 0.
            step = 1 if kind == "integer" else 1e-3
            lo = schema.get("minimum", schema.get("exclusiveMinimum", 0) + step)
            hi = schema.get("maximum", schema.get("exclusiveMaximum", 50 + step) - step)
            inside = (rng.randint(max(lo, -10**6), min(hi, 10**6)) if kind == "integer"
                      else rng.uniform(max(lo, -1e3), min(hi, 1e3)))
            return rng.choice([lo, hi, inside])
        if kind == "boolean":
            return rng.random() < 0.5
        return None

    def mutate(self, body: dict) -> None:
        rng = self.rng
        if body and rng.random() < 0.5:
            key = rng.choice(sorted(body))
            body[key] = rng.choice([None, -1, 1e308, "str", [], {}, [1, "a"], True])
        elif body and rng.random() < 0.5:
            del body[rng.choice(sorted(body))]
        else:
            body["unknown_field"] = rng.choice([1, "x", None])


def test_fuzzed_bodies_from_the_openapi_schema_never_get_a_5xx(http, server, wait_idle):
    # schemathesis explores the same schema in test_openapi.py; this is the quick, seeded pass
    # that also reads every stream for an error event and checks the adapter set is unchanged.
    spec = http.get("/schema/openapi.json").json()
    operations = [(path, op["requestBody"]["content"]["application/json"]["schema"])
                  for path, item in spec["paths"].items() for method, op in item.items()
                  if method == "post" and "application/json" in op.get("requestBody", {})
                  .get("content", {})]
    paths = {path for path, _ in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter"} <= paths
    fuzzer = SchemaFuzzer(spec, seed=20240517)
    statuses: dict[int, int] = {}
    generation = [op for op in operations if op[0] in ("/v1/completions",
                                                        "/v1/chat/completions")]
    for i in range(FUZZ_CASES):
        path, schema = operations[i % len(operations)] if i % 3 == 0 else generation[i % 2]
        body = fuzzer.body(schema)
        r = http.post(path, json=body)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, f"{path} {json.dumps(body)[:500]} -> {r.status_code} {r.text}"
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            assert '"error"' not in r.text, f"{path} {body} streamed an error: {r.text[-500:]}"
    assert statuses.get(200, 0) >= FUZZ_CASES // 10, f"too few valid bodies: {statuses}"
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) >= FUZZ_CASES // 10
    assert set(server.services.adapters.records) == {f"lora-{i}" for i in range(8)}
    wait_idle(server.services)
