"""An adapter that speaks another chat family than its base, served beside it: the Qwen3 family
model (thinking, Hermes calls) with a LoRA trained to answer as Qwen3-Coder does (no thinking,
XML calls; chat_adapters.py), whose folder holds chat_template.jinja, the tokenizer's
tokenizer_config.json and a generation_config.json of its own, as a trainer saves them.

    registered   from its folder: its template picks its parsers (the flags say auto), its
                 generation config its defaults; /v1/models and the admin API say so
    one batch    the base's and the adapter's requests at once, whole and streamed: each read
                 in its own family's syntax
    uploaded     the same files as multipart fields, the parsers named by fields
    versions     an earlier version a request pins speaks as it did
    refused      an unknown parser, a template that does not render, tokens the base lacks, a
                 generation config that is not JSON: 422, and nothing stored
    a fleet      uploaded through one replica, served by another from the object store: the
                 chat travels in the catalog
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from chat_adapters import GENERATION, ChatAdapter, train_chat_adapter
from chat_families import FAMILIES
from chat_replies import ask, assert_answers
from family_models import PROMPTS
from family_servers import start_server
from fleet_harness import KEY, load_fixture_module, running_fleet
from transformers import AutoTokenizer

from loragw.gateway.bench.server import wait_ready
from loragw.gateway.fleet.router import FORWARDED_HEADER

pytestmark = pytest.mark.slow
BASE, SPEAKS = "qwen3", "qwen3_coder"
s3_fixture = load_fixture_module("s3_server")


@pytest.fixture(scope="module")
def coder(family_models, tmp_path_factory) -> ChatAdapter:
    """The LoRA, its folder also holding the base tokenizer's tokenizer_config.json (every
    token it adds is the base's own)."""
    base = family_models[BASE]
    adapter = train_chat_adapter(base, FAMILIES[SPEAKS], tmp_path_factory.mktemp("coder"))
    shutil.copy(base.directory / "tokenizer_config.json", adapter.directory)
    return adapter


@pytest.fixture(scope="module")
def server(family_models, coder, tmp_path_factory):
    served = start_server(family_models[BASE], tmp_path_factory.mktemp("serve-adapter-chat"),
                          ("--adapter-versions-kept", "2"))
    try:
        wait_ready(served.url, served.process, served.log)
        yield served
    finally:
        served.process.terminate()
        served.process.wait(timeout=30)
        served.log.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def registered(http, coder) -> dict:
    response = http.post("/admin/adapters/register",
                         json={"adapter_id": "coder", "source": str(coder.directory)})
    assert response.status_code == 201, response.text
    return response.json()


def files(coder: ChatAdapter) -> dict:
    return {name: (f"{name}.bin", (coder.directory / path).read_bytes())
            for name, path in (("adapter_config", "adapter_config.json"),
                               ("adapter_model", "adapter_model.safetensors"))}


def upload(http, adapter_id: str, coder: ChatAdapter, replace: bool = False,
           **fields) -> httpx.Response:
    """The weights as multipart files; `fields` (text) beside them."""
    return http.post("/admin/adapters", data={"adapter_id": adapter_id,
                                              "replace": str(replace).lower(), **fields},
                     files=files(coder))


def test_its_own_template_picks_its_parsers(http, registered):
    assert registered["chat_template"] and registered["generation_config"], registered
    assert registered["tool_call_parser"] == registered["reasoning_parser"] == ""  # from files
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert (cards[BASE]["reasoning_parser"], cards[BASE]["tool_call_parser"]) == ("qwen3",
                                                                                  "hermes")
    assert (cards["coder"]["reasoning_parser"], cards["coder"]["tool_call_parser"]) == (
        None, "qwen3_coder")


@pytest.mark.usefixtures("registered")
def test_base_and_adapter_in_one_batch_each_read_in_its_family(client, family_models, coder):
    asks = [(BASE, key, stream) for key in ("call", "plain") for stream in (False, True)]
    asks += [("coder", key, stream) for key in ("call", "plain") for stream in (False, True)]
    with ThreadPoolExecutor(len(asks)) as pool:  # all queued at once: they share steps
        replies = list(pool.map(lambda a: ask(client, a[0], PROMPTS[a[1]], a[2]), asks))
    for (model, key, _), reply in zip(asks, replies, strict=True):
        answers = family_models[BASE].answers if model == BASE else coder.answers
        assert_answers(reply, answers[key], BASE if model == BASE else SPEAKS)
    assert replies[0].without_ids() == replies[1].without_ids()  # whole == streamed


@pytest.mark.usefixtures("registered")
def test_its_generation_config_sets_its_defaults(client):
    def plain(model: str):
        return client.chat.completions.create(model=model, temperature=0,
                                              messages=list(PROMPTS["plain"].messages))

    capped = plain("coder")
    assert capped.usage.completion_tokens == GENERATION["max_new_tokens"]
    assert capped.choices[0].finish_reason == "length"
    assert plain(BASE).choices[0].finish_reason == "stop"  # the base's own defaults


@pytest.mark.usefixtures("registered")
def test_tokenize_renders_with_the_adapters_template(http, family_models, coder):
    prompt = PROMPTS["call"]
    body = {"messages": list(prompt.messages), "tools": list(prompt.tools)}
    tokenizer = AutoTokenizer.from_pretrained(family_models[BASE].directory)
    for model, template in ((BASE, None), ("coder", coder.template)):
        response = http.post("/tokenize", json={"model": model, **body})
        assert response.status_code == 200, response.text
        expected = tokenizer.apply_chat_template(list(prompt.messages), tools=list(prompt.tools),
                                                 chat_template=template, tokenize=False,
                                                 add_generation_prompt=True)
        assert response.json()["tokens"] == tokenizer.encode(expected, add_special_tokens=False)


def test_uploaded_with_its_chat_as_fields_and_pinned_it_speaks_as_it_did(http, client, coder):
    response = upload(http, "coder-up", coder, chat_template=coder.template,
                      tool_call_parser="qwen3_coder", reasoning_parser="none",
                      generation_config=json.dumps(GENERATION))
    assert response.status_code == 201, response.text
    info = response.json()
    assert (info["reasoning_parser"], info["tool_call_parser"]) == ("none", "qwen3_coder")
    assert_answers(ask(client, "coder-up", PROMPTS["call"], True), coder.answers["call"], SPEAKS)

    again = upload(http, "coder-up", coder, replace=True)  # version 2: speaks as the base
    assert again.status_code == 201, again.text
    assert again.json()["version"] == 2 and not again.json()["chat_template"]
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert cards["coder-up"]["tool_call_parser"] == "hermes"
    pinned = ask(client, "coder-up@1", PROMPTS["call"], False)
    assert_answers(pinned, coder.answers["call"], SPEAKS)


@pytest.mark.parametrize("fields, says", [
    ({"reasoning_parser": "nope"}, "reasoning_parser 'nope' is not one of"),
    ({"tool_call_parser": "qwen4"}, "tool_call_parser 'qwen4' is not one of"),
    ({"chat_template": "{% for m in messages %}{{ m.content }"}, "does not render"),
    ({"tokenizer_config": json.dumps({"added_tokens_decoder": {
        "9999": {"content": "<|brand_new|>", "special": True}}})}, "<|brand_new|>"),
    ({"generation_config": "{temperature: 0.1"}, "generation_config.json is not valid JSON"),
    ({"generation_config": '{"top_k": "many"}'}, "top_k must be a number"),
], ids=["reasoning", "tools", "template", "added-token", "generation-json", "generation-value"])
def test_a_chat_it_cannot_serve_is_refused_and_nothing_is_stored(http, coder, fields, says):
    response = upload(http, "refused", coder, **fields)
    assert response.status_code == 422, response.text
    assert says in response.json()["error"]["message"]
    assert http.get("/admin/adapters/refused").status_code == 404


# --- two replicas: the chat travels in the catalog -------------------------------------------

@pytest.fixture(scope="module")
def fleet(family_models, tmp_path_factory):
    s3 = s3_fixture.shared_server()
    bucket = s3.create_bucket()
    with running_fleet(tmp_path_factory.mktemp("chat-fleet"), str(family_models[BASE].directory),
                       "r1", "r2", s3=s3, store_url=f"s3://{bucket}/adapters",
                       extra=("--max-model-len", "2048")) as fleet:
        yield fleet


def test_a_second_replica_serves_it_in_its_own_family(fleet, coder):
    config, weights = (coder.directory / "adapter_config.json").read_bytes(), \
        (coder.directory / "adapter_model.safetensors").read_bytes()
    response = fleet.http.post(fleet.urls["r1"] + "/admin/adapters",
                               data={"adapter_id": "coder", "chat_template": coder.template,
                                     "generation_config": json.dumps(GENERATION)},
                               files={"adapter_config": ("adapter_config.json", config),
                                      "adapter_model": ("adapter_model.safetensors", weights)})
    assert response.status_code == 201, response.text
    fleet.wait_for("r2 to list it", lambda: "coder" in fleet.models("r2"), timeout=5)
    assert fleet.models("r2")["coder"]["tool_call_parser"] == "qwen3_coder"
    with openai.OpenAI(base_url=fleet.urls["r2"] + "/v1", api_key=KEY, max_retries=0,
                       timeout=120, default_headers={FORWARDED_HEADER: "chat"}) as client:
        # the marker makes r2 serve it itself: its bytes from the store, its chat from Redis
        reply = ask(client, "coder", PROMPTS["call"], True)
    assert_answers(reply, coder.answers["call"], SPEAKS)
    assert fleet.admin("r2")["coder"]["residency"] in ("device", "host")
