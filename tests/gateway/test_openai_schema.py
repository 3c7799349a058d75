"""Every body the gateway sends, checked against OpenAI's own published response schemas
(tests/gateway/openai_schemas.json: the components of github.com/openai/openai-openapi at
f85dbe2, MIT licence): real responses from the live server, whole and streamed, with tool
calls, json_schema outputs, n > 1, logprobs and usage, and the errors of every status.

Streams may carry what the live API sends beyond the schema, and only that: a completion
chunk `finish_reason: null` and `usage: null`; a chat chunk `logprobs: null`,
`finish_reason: null` and `usage: null`."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import httpx
import jsonschema
import pytest
from litestar.testing import TestClient

from loragw.gateway.app import create_app
from loragw.gateway.common.config import MB
from loragw.gateway.services import Services

BASE = "demo-base"  # conftest's served model name
ADAPTER = "lora-2"
SCHEMAS = json.loads((Path(__file__).parent / "openai_schemas.json").read_text())
SMALL = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
T1 = {"temperature": 1.0, "max_tokens": 150}  # structured outputs: the grammar ends them
MESSAGES = [{"role": "user", "content": "What is the weather?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "temp": {"type": "integer"}},
           "required": ["city", "temp"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}},
             "required": ["a"]}}}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}


def _nullable(schema: dict, *path: str) -> None:
    """Let the property at `path` (a "choices" step means its items) also be null."""
    *parents, leaf = path
    for step in parents:
        schema = schema["properties"][step]
        if step == "choices":
            schema = schema["items"]
    schema["properties"][leaf] = {"anyOf": [schema["properties"][leaf], {"type": "null"}]}


def _stream_schemas() -> dict:
    """The schemas with only the live API's documented stream extras allowed."""
    schemas = copy.deepcopy(SCHEMAS)
    defs = schemas["$defs"]
    for name, fields in (("CreateCompletionResponse", ("finish_reason",)),
                         ("CreateChatCompletionStreamResponse", ("finish_reason", "logprobs"))):
        for field in fields:
            _nullable(defs[name], "choices", field)
        _nullable(defs[name], "usage")
    return schemas


STREAM_SCHEMAS = _stream_schemas()


def conforms(body: dict, name: str, stream: bool = False) -> None:
    """Assert `body` validates as OpenAI's component `name`, listing every violation."""
    root = STREAM_SCHEMAS if stream else SCHEMAS
    validator = jsonschema.Draft202012Validator({**root, "$ref": f"#/$defs/{name}"})
    errors = [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
              for e in validator.iter_errors(body)]
    assert not errors, f"{name}: {json.dumps(body)[:800]}\n" + "\n".join(errors)


def events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    """A stream's JSON events, after checking it is SSE that ends with [DONE]."""
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    frames = raw.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""] and all(f.startswith("data: ") for f in frames[:-1])
    return [json.loads(f[6:]) for f in frames[:-2]]


def post(http: httpx.Client, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


COMPLETIONS = {
    "plain": {"model": BASE, "prompt": "hello", **SMALL},
    "adapter, n=2, prompt batch": {"model": ADAPTER, "prompt": ["a", "b"], "n": 2, "seed": 1,
                                   **SMALL},
    "logprobs": {"model": ADAPTER, "prompt": "hello", "logprobs": 3, **SMALL},
    "echo": {"model": BASE, "prompt": "echo me", "echo": True, **SMALL},
    "stop": {"model": BASE, "prompt": "hello", "max_tokens": 8, "temperature": 0,
             "stop": ["e", "a", "o", "i"]},
    "json_schema": {"model": BASE, "prompt": "JSON:", "seed": 3, "response_format": FORMAT,
                    **T1},
    "guided_choice": {"model": ADAPTER, "prompt": "Pick:", "guided_choice": ["l", "r"], **T1},
}
CHATS = {
    "plain": {"model": BASE, "messages": MESSAGES, **SMALL},
    "adapter, n=3": {"model": ADAPTER, "messages": MESSAGES, "n": 3, "seed": 2, **SMALL,
                     "temperature": 1.0},
    "logprobs": {"model": ADAPTER, "messages": MESSAGES, "logprobs": True, "top_logprobs": 2,
                 **SMALL},
    "logprobs, no top": {"model": BASE, "messages": MESSAGES, "logprobs": True, **SMALL},
    "json_schema": {"model": BASE, "messages": MESSAGES, "seed": 4, "response_format": FORMAT,
                    **T1},
    "tool_choice required, n=2": {"model": ADAPTER, "messages": MESSAGES, "tools": TOOLS,
                                  "tool_choice": "required", "n": 2, "seed": 5, **T1},
    "named tool, logprobs": {"model": BASE, "messages": MESSAGES, "tools": TOOLS, "seed": 6,
                             "tool_choice": {"type": "function", "function": {"name": "add"}},
                             "logprobs": True, **T1},
    "tool_choice auto": {"model": BASE, "messages": MESSAGES, "tools": TOOLS,
                         "tool_choice": "auto", **SMALL},
}
USAGE = {"stream_options": {"include_usage": True}}


@pytest.mark.parametrize("case", COMPLETIONS)
def test_completions_whole_and_streamed_conform(http, case):
    body = COMPLETIONS[case]
    conforms(post(http, "/v1/completions", body), "CreateCompletionResponse")
    for extra in ({}, USAGE):
        chunks = events(http, "/v1/completions", {**body, **extra})
        for chunk in chunks:
            conforms(chunk, "CreateCompletionResponse", stream=True)
        assert ("usage" in chunks[-1] and chunks[-1]["usage"] is not None) == bool(extra)


@pytest.mark.parametrize("case", CHATS)
def test_chat_whole_and_streamed_conform(http, case):
    body = CHATS[case]
    whole = post(http, "/v1/chat/completions", body)
    conforms(whole, "CreateChatCompletionResponse")
    if "tool_choice" in body and body["tool_choice"] != "auto":
        assert all(c["message"]["tool_calls"] and c["finish_reason"] == "tool_calls"
                   for c in whole["choices"]), whole
    for extra in ({}, USAGE):
        chunks = events(http, "/v1/chat/completions", {**body, **extra})
        for chunk in chunks:
            conforms(chunk, "CreateChatCompletionStreamResponse", stream=True)
        assert (chunks[-1].get("usage") is not None) == bool(extra)


def test_chat_messages_say_refusal_and_omit_absent_tool_calls(http):
    whole = post(http, "/v1/chat/completions", CHATS["logprobs"])
    message, logprobs = whole["choices"][0]["message"], whole["choices"][0]["logprobs"]
    assert message["refusal"] is None and "tool_calls" not in message
    assert logprobs["refusal"] is None and logprobs["content"]


def test_models_conform_with_their_extension_fields(http, adapter_names):
    listing = http.get("/v1/models").json()
    conforms(listing, "ListModelsResponse")
    assert {"residency", "max_model_len"} <= set(listing["data"][0])  # extensions still sent
    for model in (BASE, adapter_names[0]):
        conforms(http.get(f"/v1/models/{model}").json(), "Model")


def _error(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, r.text
    conforms(r.json(), "ErrorResponse")


def test_errors_of_every_status_conform(http, server, server_config, tmp_path, monkeypatch):
    chat = {"model": BASE, "messages": MESSAGES, **SMALL}
    _error(http.post("/v1/chat/completions", json={**chat, "top_p": 2}), 400)  # decoding
    _error(http.post("/v1/chat/completions", content=b"{",
                     headers={"content-type": "application/json"}), 400)
    _error(http.post("/v1/completions", json={"model": BASE, "prompt": [1] * 600}), 400)
    _error(http.post("/v1/chat/completions", json={**chat, "model": "nope"}), 404)
    _error(http.get("/v1/models/nope"), 404)
    _error(http.get("/v1/no-such-route"), 404)
    _error(http.get("/v1/completions"), 405)
    _error(http.post("/v1/completions", content=b" " * (33 * MB),
                     headers={"content-type": "application/json"}), 413)
    _error(http.post("/v1/load_lora_adapter", json={"lora_name": "bad",
                                                     "lora_path": str(tmp_path)}), 422)
    services = server.services
    services.capacity.inflight += services.config.max_capacity
    try:
        _error(http.post("/v1/chat/completions", json=chat), 429)
    finally:
        services.capacity.inflight -= services.config.max_capacity
    keyed = create_app(replace(server_config, api_key="k", admin_key="a"), services=services)
    with TestClient(keyed) as c:
        _error(c.post("/v1/chat/completions", json=chat), 401)
        _error(c.get("/admin/adapters", headers={"Authorization": "Bearer k"}), 401)
    with TestClient(create_app(server_config, services=Services(server_config))) as c:
        _error(c.post("/v1/chat/completions", json=chat), 503)
        _error(c.get("/ready"), 503)

    def broken(*_):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(services.adapters, "residency", broken)  # each adapter's card reads it
    _error(http.get("/v1/models"), 500)
