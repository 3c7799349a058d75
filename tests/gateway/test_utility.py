"""vLLM's utility routes through the live gateway: /tokenize (a prompt, or chat messages through
the chat template), /detokenize, /version; adapters use the base tokenizer, unknown models are a
404, and the API key guards them as it guards /v1."""

from __future__ import annotations

from dataclasses import replace

import pytest
from litestar.testing import AsyncTestClient

from loragw.gateway.app import create_app
from loragw.gateway.openai.utility import UNKNOWN_VERSION, package_version

BASE = "demo-base"  # conftest's served model name
ADAPTER = "lora-3"
MAX_MODEL_LEN = 512  # conftest's
TEXT = "Tell me a story about a pirate"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest.mark.parametrize("model", [BASE, ADAPTER])
def test_tokenize_a_prompt_as_completions_encodes_it(http, client, model):
    r = http.post("/tokenize", json={"model": model, "prompt": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    usage = client.completions.create(model=model, prompt=TEXT, max_tokens=1).usage
    assert body["count"] == usage.prompt_tokens
    bare = http.post("/tokenize", json={"model": model, "prompt": TEXT,
                                        "add_special_tokens": False}).json()
    assert bare["tokens"] == body["tokens"][1:]  # the BOS the tokenizer adds, and only that


def test_tokenize_messages_as_the_chat_route_renders_them(http, client):
    body = http.post("/tokenize", json={"model": ADAPTER, "messages": MESSAGES,
                                        "return_token_strs": True}).json()
    usage = client.chat.completions.create(model=ADAPTER, messages=MESSAGES, max_tokens=1).usage
    assert body["count"] == usage.prompt_tokens == len(body["token_strs"])
    assert body["token_strs"][0] == "<|begin_of_text|>"


def test_detokenize_round_trips(http):
    tokens = http.post("/tokenize", json={"model": BASE, "prompt": TEXT,
                                          "add_special_tokens": False}).json()["tokens"]
    for model in (BASE, ADAPTER):
        r = http.post("/detokenize", json={"model": model, "tokens": tokens})
        assert r.status_code == 200 and r.json() == {"prompt": TEXT}


def test_version_is_the_package_version(http):
    r = http.get("/version")
    assert r.status_code == 200 and r.json() == {"version": package_version()}
    assert package_version() != UNKNOWN_VERSION  # installed in the venv (editable)


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"model": "no-such-model", "tokens": [1]}, 404, "model"),
    ("/tokenize", {"model": BASE}, 400, "prompt"),
    ("/tokenize", {"model": BASE, "prompt": "x", "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {"model": BASE, "messages": MESSAGES, "add_special_tokens": True}, 400,
     "add_special_tokens"),
    ("/detokenize", {"model": BASE, "tokens": [10**7]}, 400, "tokens"),
    ("/detokenize", {"model": BASE, "tokens": [-1]}, 400, "tokens"),
])
def test_bad_requests_are_openai_errors(http, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"].startswith(param)  # tokens[0] from the body's schema


async def test_the_api_key_guards_them(server, server_config):
    app = create_app(replace(server_config, api_key="user-key"), services=server.services)
    user = {"Authorization": "Bearer user-key"}
    async with AsyncTestClient(app) as c:
        for method, path, body in (("POST", "/tokenize", {"model": BASE, "prompt": "hi"}),
                                   ("POST", "/detokenize", {"model": BASE, "tokens": [1]}),
                                   ("GET", "/version", None)):
            assert (await c.request(method, path, json=body)).status_code == 401
            wrong = await c.request(method, path, json=body, headers={"Authorization": "Bearer x"})
            assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
            assert (await c.request(method, path, json=body, headers=user)).status_code == 200
        body = {"model": BASE, "input": "hi", "max_output_tokens": 2}
        assert (await c.post("/v1/responses", json=body)).status_code == 401
        assert (await c.post("/v1/responses", json=body, headers=user)).status_code == 200
