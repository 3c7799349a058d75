"""Prompt logprobs through the API: the legacy completions API's `echo` with `logprobs` (what
lm-evaluation-harness sends for every loglikelihood task), `max_tokens: 0` with echo, and vLLM's
`prompt_logprobs` on completions and chat; each the engine's own numbers (whose parity with
transformers + PEFT tests/engine/test_prompt_logprobs.py holds), and the refusals."""

from __future__ import annotations

import json

import openai
import pytest
from random_adapters import ADAPTERS, BASE

from loragw.engine import SamplingParams

PROMPT = "The ocean is wide and the ships are"


def offline_prompt_logprobs(offline, adapter: str, n: int):
    ids = offline.tokenizer.encode(PROMPT)
    engine = offline.engine
    rid = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0,
                                                 prompt_logprobs=n), adapter)
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and first is None:
                first = out
    return ids, first.prompt_logprobs


def test_echo_with_logprobs_and_max_tokens_0_give_the_prompts_logprobs(client, offline):
    ids, want = offline_prompt_logprobs(offline, ADAPTERS[1], 2)
    r = client.completions.create(model=ADAPTERS[1], prompt=PROMPT, echo=True, logprobs=2,
                                  max_tokens=0, temperature=0)
    choice = r.choices[0]
    assert choice.text == PROMPT and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    for got, entry in zip(lp.token_logprobs[1:], want[1:], strict=True):
        assert abs(got - entry.logprob) < 1e-4
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)


def test_echo_with_logprobs_then_generated_tokens_streamed_or_not(client):
    body = dict(model=ADAPTERS[2], prompt=PROMPT, echo=True, logprobs=1, max_tokens=3,
                temperature=0)
    whole = client.completions.create(**body).choices[0]
    assert whole.text.startswith(PROMPT) and len(whole.text) > len(PROMPT)
    generated = client.completions.create(**{**body, "echo": False}).choices[0]
    n_prompt = len(whole.logprobs.tokens) - len(generated.logprobs.tokens)
    assert whole.logprobs.token_logprobs[n_prompt:] == pytest.approx(
        generated.logprobs.token_logprobs, abs=1e-5)
    chunks = list(client.completions.create(**body, stream=True))
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT) and first.logprobs.token_logprobs[0] is None
    assert "".join(c.choices[0].text for c in chunks) == whole.text


def test_vllm_prompt_logprobs_on_completions_and_chat(http):
    r = http.post("/v1/completions", json={"model": BASE, "prompt": PROMPT, "max_tokens": 2,
                                           "temperature": 0, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) > 3
    for entry in entries[1:]:
        assert 1 <= len(entry) <= 2  # the token itself and its top alternative
        assert all({"logprob", "rank", "decoded_token"} <= set(v) for v in entry.values())
    plain = http.post("/v1/completions", json={"model": BASE, "prompt": PROMPT,
                                               "max_tokens": 2, "temperature": 0})
    assert "prompt_logprobs" not in plain.json()["choices"][0]
    chat = http.post("/v1/chat/completions", json={
        "model": ADAPTERS[0], "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 2, "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["prompt_logprobs"][0] is None


@pytest.mark.parametrize("body, param", [
    ({"prompt_logprobs": 1, "n": 2}, "prompt_logprobs"),
    ({"logprobs": 21, "echo": True}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 1, "prompt": [5] * 600}, "max_tokens"),
])
def test_bad_prompt_logprob_requests_are_400s_naming_the_parameter(http, body, param):
    full = {"model": BASE, "prompt": PROMPT, "max_tokens": 1, **body}
    r = http.post("/v1/completions", json=full)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, json.dumps(r.json())


def test_the_openai_client_reads_echoed_logprobs(client):
    r = client.completions.create(model=BASE, prompt=[5, 6, 7, 8], echo=True, logprobs=0,
                                  max_tokens=0)
    assert r.choices[0].logprobs.token_logprobs[0] is None
    assert len(r.choices[0].logprobs.tokens) == 4
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=BASE, prompt="hi", max_tokens=0)
