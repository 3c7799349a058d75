"""The OpenAI API as the official `openai` client sees it, against the live server: outputs
at temperature 0 equal the offline engine's, for the base model and adapters, alone and mixed
in one batch, streamed or not."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from loragw.engine import SamplingParams
from loragw.engine.request.tokenizer import encode_chat

BASE = "demo-base"  # conftest's served model name
ADAPTERS = [f"lora-{i}" for i in range(8)]  # conftest's adapters
PROMPTS = ["Tell me about the ocean", "What is the capital of France?", "Write a poem about tea",
           "How do I bake bread?", "Why is the sky blue?", "hello", "Describe a dragon",
           "Give me three facts about trains"]
GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})


def greedy_params(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def offline_texts(offline, prompts, adapters, params=None) -> list[str]:
    outs = offline.generate(prompts, params or greedy_params(), adapters=adapters)
    return [o.text for o in outs]


def adapter_of(model: str) -> str | None:
    return None if model == BASE else model


def test_completions_equal_the_offline_engine_for_base_and_adapters(client, offline):
    models = [BASE, ADAPTERS[0], ADAPTERS[1]]
    got = [client.completions.create(model=m, prompt=PROMPTS[0], **GREEDY) for m in models]
    expected = offline_texts(offline, [PROMPTS[0]] * 3, [adapter_of(m) for m in models])
    assert [r.choices[0].text for r in got] == expected
    assert len(set(expected)) == 3, "the adapters should change the output"
    r = got[1]
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == ADAPTERS[0]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPTS[0]))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_equals_the_offline_engine_streamed_or_not(client, offline):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": PROMPTS[1]}]}]
    ids = encode_chat(offline.tokenizer, [messages[0], {"role": "user", "content": PROMPTS[1]}])
    expected = offline_texts(offline, [ids], [ADAPTERS[2]])[0]
    whole = client.chat.completions.create(model=ADAPTERS[2], messages=messages, **GREEDY)
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == len(ids)

    chunks = list(client.chat.completions.create(model=ADAPTERS[2], messages=messages,
                                                 stream=True, **GREEDY,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and not any(finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    capped = client.chat.completions.create(model=ADAPTERS[2], messages=messages, temperature=0,
                                            max_tokens=12, max_completion_tokens=5,
                                            extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == 5 and expected.startswith(
        capped.choices[0].message.content)


def test_streamed_completion_is_server_sent_events_ending_with_done(http, offline):
    body = {"model": ADAPTERS[3], "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: ") for e in events[:-1])
    expected = offline_texts(offline, [PROMPTS[2]], [ADAPTERS[3]], greedy_params(8))[0]
    chunks = [json.loads(e[6:]) for e in events[:-2]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_base_and_adapters_in_one_concurrent_batch(server, offline):
    models = [BASE, *ADAPTERS[:3]] * 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(models))]
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x",
                                  max_retries=0) as aclient:
        async def one(model, prompt, stream):
            if not stream:
                r = await aclient.completions.create(model=model, prompt=prompt, **GREEDY)
                return r.choices[0].text
            parts = []
            async for chunk in await aclient.completions.create(model=model, prompt=prompt,
                                                                stream=True, **GREEDY):
                parts.append(chunk.choices[0].text)
            return "".join(parts)

        got = await asyncio.gather(*(one(m, p, i % 2 == 1)
                                     for i, (m, p) in enumerate(zip(models, prompts, strict=True))))
    assert got == offline_texts(offline, prompts, [adapter_of(m) for m in models])


def test_n_choices_differ_and_reproduce_with_a_seed(client):
    kw = dict(model=ADAPTERS[0], prompt=PROMPTS[3], max_tokens=8, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    first = client.completions.create(n=3, **kw)
    again = client.completions.create(n=3, **kw)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) == 3
    # choice i is seeded with seed + i: choice 1 equals a single request seeded 1235
    kw["seed"] = 1235
    assert client.completions.create(**kw).choices[0].text == texts[1]
    assert first.usage.completion_tokens == 24


def test_prompt_batches_give_one_choice_per_prompt_times_n(client, offline):
    ids = offline.tokenizer.encode(PROMPTS[5])
    r = client.completions.create(model=BASE, prompt=[PROMPTS[4], PROMPTS[5]], n=2, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    expected = offline_texts(offline, [PROMPTS[4], PROMPTS[5]], [None, None])
    assert [c.text for c in r.choices] == [expected[0]] * 2 + [expected[1]] * 2
    by_ids = client.completions.create(model=BASE, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == expected[1]
    nested = client.completions.create(model=BASE, prompt=[ids, ids], **GREEDY)
    assert [c.text for c in nested.choices] == [expected[1]] * 2
    assert nested.usage.prompt_tokens == 2 * len(ids)


def test_stop_sequences_end_the_text_before_them(client, offline):
    full = offline_texts(offline, [PROMPTS[6]], [ADAPTERS[4]], greedy_params(16))[0]
    starts = [i for i in range(len(full) // 2, len(full) - 1)
              if not any(c.isspace() or c == "\ufffd" for c in full[i:i + 2])]
    assert starts, f"no visible stop string to pick in {full!r}"
    stop = full[starts[0]:starts[0] + 2]
    r = client.completions.create(model=ADAPTERS[4], prompt=PROMPTS[6], max_tokens=16,
                                  temperature=0, stop=[stop, "never-there"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    ids = offline.generate([PROMPTS[6]], greedy_params(16), adapters=[ADAPTERS[4]])[0].token_ids
    by_id = client.completions.create(model=ADAPTERS[4], prompt=PROMPTS[6], max_tokens=16,
                                      temperature=0, extra_body={"ignore_eos": True,
                                                                 "stop_token_ids": [ids[3]]})
    assert by_id.choices[0].finish_reason == "stop"
    assert by_id.usage.completion_tokens == ids.index(ids[3]) + 1
    streamed = client.chat.completions.create(model=BASE, messages=[{"role": "user",
                                                                    "content": "hi"}],
                                              max_tokens=16, temperature=0, stop=stop,
                                              stream=True, extra_body={"ignore_eos": True})
    assert stop not in "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)


def test_logprobs_in_openai_shape(client, offline):
    r = client.completions.create(model=ADAPTERS[5], prompt=PROMPTS[7], logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    if not any("\ufffd" in t for t in lp.tokens):  # tokens that split a character don't add up
        assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 1 <= len(top) <= 3
        assert all(lp <= logprob + 1e-4 for lp in top.values())  # greedy took the best one
        assert token in top
    ref = offline.generate([PROMPTS[7]], greedy_params(logprobs=3), adapters=[ADAPTERS[5]])[0]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)

    chat = client.chat.completions.create(model=BASE, messages=[{"role": "user",
                                                                "content": "hello"}],
                                          logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 12
    if not any("\ufffd" in t.token for t in content):
        assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)
    plain = client.chat.completions.create(model=BASE, messages=[{"role": "user",
                                                                 "content": "hello"}], **GREEDY)
    assert plain.choices[0].logprobs is None


def test_models_lists_base_and_adapters_with_parent(client, base_name, adapter_names):
    assert (base_name, adapter_names) == (BASE, ADAPTERS)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {BASE, *ADAPTERS}
    assert models[BASE].parent is None
    assert all(models[a].parent == BASE for a in ADAPTERS)
    assert all(m.object == "model" and m.owned_by for m in models.values())
    assert {m.residency for m in models.values()} <= {"device", "host", "disk"}
    resident = [a for a in ADAPTERS if models[a].residency == "device"]
    assert len(resident) <= 4
    assert client.models.retrieve(ADAPTERS[3]).parent == BASE
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/not-there")


def test_load_use_unload_adapter_at_runtime(http, client, server, make_adapter, wait_idle,
                                            tmp_path, engine_state):
    path = make_adapter(tmp_path / "late", seed=7)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path})
    assert r.status_code == 200, r.text
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path})
    assert again.status_code == 400 and again.json()["error"]["code"] == "adapter_exists"
    out = client.completions.create(model="late", prompt=PROMPTS[0], **GREEDY)
    base = client.completions.create(model=BASE, prompt=PROMPTS[0], **GREEDY)
    assert out.choices[0].text != base.choices[0].text
    assert "late" in {m.id for m in client.models.list().data}

    # unloading ends the requests still using it with finish_reason "abort", never a hang
    body = {"model": "late", "prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as streaming:
        lines = streaming.iter_lines()
        assert next(lines).startswith("data: {")
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert r.status_code == 200, r.text
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] == "abort"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] < 400
    assert "late" not in engine_state(server.services).residency  # really gone from the engine
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="late", prompt=PROMPTS[0], **GREEDY)
    assert err.value.body["code"] == "model_not_found"
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert bad.status_code == 422 and bad.json()["error"]["message"]
    wait_idle(server.services)


async def test_64_concurrent_streams_over_8_adapters_with_4_slots(server, offline, wait_idle,
                                                                  engine_state):
    jobs = [(ADAPTERS[i % 8], PROMPTS[(i // 8 + i) % len(PROMPTS)]) for i in range(64)]
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                  timeout=300,
                                  http_client=httpx.AsyncClient(limits=limits)) as aclient:
        async def one(model, prompt):
            parts, reasons = [], []
            stream = await aclient.completions.create(model=model, prompt=prompt, stream=True,
                                                      **GREEDY)
            async for chunk in stream:
                parts.append(chunk.choices[0].text)
                reasons.append(chunk.choices[0].finish_reason)
            assert reasons[-1] == "length"
            return "".join(parts)

        got = await asyncio.gather(*(one(m, p) for m, p in jobs))
    # The offline engine runs each adapter's requests together; the engine's parity tests
    # hold batched greedy output equal to solo output.
    expected = offline_texts(offline, [p for _, p in jobs], [m for m, _ in jobs])
    mismatched = [i for i in range(64) if got[i] != expected[i]]
    assert not mismatched, f"{len(mismatched)} of 64 differ, e.g. {jobs[mismatched[0]]}"
    solo = offline_texts(offline, [jobs[9][1]], [jobs[9][0]])[0]
    assert got[9] == solo
    wait_idle(server.services)
    assert engine_state(server.services).evictions["device"] > 0, "8 adapters in 4 slots must swap"


# ---- logit_bias, echo and vLLM's sampling extensions ------------------------------------------
def test_logit_bias_bans_and_forces_tokens_on_both_routes(client, offline):
    ids = offline.generate([PROMPTS[0]], greedy_params(4))[0].token_ids
    forced = client.completions.create(model=ADAPTERS[1], prompt=PROMPTS[0],
                                       logit_bias={"77": 100}, **GREEDY)
    assert forced.choices[0].text == offline.tokenizer.decode([77] * 12)
    banned = client.completions.create(model=BASE, prompt=PROMPTS[0], max_tokens=4,
                                       temperature=0, logit_bias={str(ids[0]): -100},
                                       extra_body={"ignore_eos": True})
    expected = offline_texts(offline, [PROMPTS[0]], [None],
                             greedy_params(4, logit_bias={ids[0]: -100}))[0]
    assert banned.choices[0].text == expected != offline.tokenizer.decode(ids)
    chunks = list(client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "hi"}], logit_bias={"77": 100},
        stream=True, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == offline.tokenizer.decode([77] * 12)


@pytest.mark.parametrize(("bias", "says"), [
    ({"abc": 1}, "logit_bias key 'abc' is not a token id"),
    ({"-3": 1}, "logit_bias key '-3' is not a token id"),
    ({"10000000": 1}, "logit_bias key 10000000 is not a token of this model"),
    ({"5": 100.5}, "logit_bias[5] must be in [-100, 100], got 100.5"),
])
def test_bad_logit_bias_is_a_400_naming_the_key(client, bias, says):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=BASE, prompt="hi", max_tokens=2, logit_bias=bias)
    assert says in err.value.body["message"] and err.value.body["param"] == "logit_bias"


def test_echo_prepends_the_prompt_streamed_or_not(client, offline):
    prompts = [PROMPTS[4], PROMPTS[5]]
    expected = offline_texts(offline, prompts, [None, None])
    whole = client.completions.create(model=BASE, prompt=prompts, n=2, echo=True, **GREEDY)
    assert [c.text for c in whole.choices] == [prompts[0] + expected[0]] * 2 + \
        [prompts[1] + expected[1]] * 2
    assert whole.usage.completion_tokens == 4 * 12
    ids = offline.tokenizer.encode(PROMPTS[5])
    by_ids = client.completions.create(model=BASE, prompt=ids, echo=True, **GREEDY)
    assert by_ids.choices[0].text == offline.tokenizer.decode(ids, skip_special_tokens=True) \
        + expected[1]

    chunks = list(client.completions.create(model=ADAPTERS[0], prompt=prompts, echo=True,
                                            stream=True, **GREEDY))
    generated = offline_texts(offline, prompts, [ADAPTERS[0]] * 2)
    for index in (0, 1):
        texts = [c.choices[0].text for c in chunks if c.choices[0].index == index]
        assert texts[0] == prompts[index]  # the choice's first chunk is the prompt
        assert "".join(texts) == prompts[index] + generated[index]


def test_max_tokens_0_without_echo_is_a_clear_400(client):
    """(echo with logprobs, refused before prompt logprobs existed: test_prompt_logprobs_api.py)"""
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=BASE, prompt="hi", max_tokens=0)
    assert "echo" in err.value.body["message"] and err.value.body["param"] == "max_tokens"


def test_min_tokens_holds_off_eos_on_both_routes(client, offline):
    eos = min(offline.engine.eos_token_ids)
    body = {"min_tokens": 4}
    r = client.completions.create(model=ADAPTERS[2], prompt=PROMPTS[1], max_tokens=12,
                                  temperature=0, logit_bias={str(eos): 100}, extra_body=body)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 5
    early = client.completions.create(model=ADAPTERS[2], prompt=PROMPTS[1], max_tokens=12,
                                      temperature=0, logit_bias={str(eos): 100})
    assert early.usage.completion_tokens == 1 and early.choices[0].text == ""
    chunks = list(client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0,
        logit_bias={str(eos): 100}, stream=True, stream_options={"include_usage": True},
        extra_body=body))
    assert chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=BASE, prompt="hi", max_tokens=2,
                                  extra_body={"min_tokens": 3})
    assert err.value.body["param"] == "min_tokens"


def test_vllm_stop_and_token_extensions(client, offline):
    full = offline_texts(offline, [PROMPTS[6]], [None], greedy_params(16))[0]
    starts = [i for i in range(len(full) // 2, len(full) - 1)
              if not any(c.isspace() or c == "\ufffd" for c in full[i:i + 2])]
    stop = full[starts[0]:starts[0] + 2]
    kept = client.completions.create(model=BASE, prompt=PROMPTS[6], max_tokens=16,
                                     temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True,
                                                 "include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:full.index(stop) + 2]

    bos = offline.tokenizer.bos_token_id
    special = client.completions.create(model=BASE, prompt="hi", max_tokens=2, temperature=0,
                                        logit_bias={str(bos): 100},
                                        extra_body={"skip_special_tokens": False})
    assert special.choices[0].text == offline.tokenizer.bos_token * 2

    allowed = [40, 41, 42]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=9, ignore_eos=True,
                            allowed_token_ids=allowed)
    expected = offline.generate([PROMPTS[2]], params, adapters=[ADAPTERS[3]])[0]
    assert set(expected.token_ids) <= set(allowed)
    r = client.completions.create(model=ADAPTERS[3], prompt=PROMPTS[2], max_tokens=12,
                                  temperature=1.0, seed=9,
                                  extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert r.choices[0].text == expected.text
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=BASE, prompt="hi", max_tokens=2,
                                  extra_body={"allowed_token_ids": [1, 10**7]})
    assert err.value.body["param"] == "allowed_token_ids"
