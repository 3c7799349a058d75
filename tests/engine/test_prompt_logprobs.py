"""Prompt logprobs (engine/runner/prompt_logprobs.py): equal to transformers + PEFT's log_softmax of the
same forward, per adapter, in mixed batches, under chunked prefill, whatever the prefix cache
holds, and with a LoRA on lm_head."""

from __future__ import annotations

import pytest
import torch
from peft_reference import World, load_peft

from loragw.engine import SamplingParams
from loragw.engine.llm_engine import EngineRequest
from loragw.engine.request.params import InvalidParam

TOP = 3
TOL = 1e-4


def reference(oracle, prompt: list[int], adapter: str | None):
    """PEFT's [P-1] logprobs of prompt[1:] and [P-1, TOP] top ids, from one forward."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        if adapter is None:
            with oracle.disable_adapter():
                logits = oracle(input_ids=ids).logits[0]
        else:
            oracle.set_adapter(adapter)
            logits = oracle(input_ids=ids).logits[0]
    raw = torch.log_softmax(logits[:-1].float(), dim=-1)  # [P-1, V]
    chosen = raw.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    return chosen, raw.topk(TOP, dim=-1)


def check(out, prompt, want) -> None:
    chosen, top = want
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for p, entry in enumerate(got[1:]):
        assert entry.token_id == prompt[p + 1]
        assert abs(entry.logprob - chosen[p].item()) < TOL, (p, entry.logprob, chosen[p])
        assert [t for t, _ in entry.top] == top.indices[p].tolist()
        assert entry.rank == 1 + [t for t, _ in entry.top].index(entry.token_id) if (
            entry.token_id in [t for t, _ in entry.top]) else entry.rank > TOP
        assert all(abs(lp - r) < TOL for (_, lp), r in zip(entry.top, top.values[p].tolist()))


def run(llm, prompts, adapters, params):
    """Every request at once; each one's first output (the one with its prompt logprobs)."""
    engine = llm.engine
    ids = engine.add_requests([EngineRequest(p, params, a) for p, a in zip(prompts, adapters)])
    first = {}
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, out)
            if out.request_id in first and first[out.request_id] is not out:
                assert out.prompt_logprobs is None, "prompt logprobs are sent once"
    return [first[i] for i in ids]


@pytest.mark.parametrize("chunk", [8, 2048], ids=["chunked-prefill", "whole-prompts"])
def test_mixed_adapters_match_peft_whatever_the_prefix_cache_holds(lora_world, chunk):
    world = lora_world
    oracle = load_peft(world.base, world.dirs)
    llm = world.llm(max_num_batched_tokens=chunk, enable_prefix_caching=True)
    warm = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(world.prompts, warm, adapters=world.requests)  # the cache holds every prompt
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    outs = run(llm, world.prompts, world.requests, params)
    for out, prompt, adapter in zip(outs, world.prompts, world.requests, strict=True):
        if len(prompt) > 1:
            check(out, prompt, reference(oracle, prompt, adapter))
        assert out.num_cached_tokens == 0, "prompt logprobs come from a prefill, not the cache"
    assert llm.engine.num_free_kv_blocks == llm.engine.block_manager.num_blocks


@pytest.fixture(scope="module")
def head_world(tmp_path_factory):
    specs = {"head-q": dict(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]),
             "v-only": dict(r=8, lora_alpha=16, target_modules=["v_proj"])}
    return World(str(tmp_path_factory.mktemp("prompt-logprobs-head")), specs)


def test_an_lm_head_lora_applies_to_prompt_positions_too(head_world):
    world = head_world
    oracle = load_peft(world.base, world.dirs)
    llm = world.llm(max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP)
    keep = [i for i, p in enumerate(world.prompts) if len(p) > 1]
    prompts, adapters = [world.prompts[i] for i in keep], [world.requests[i] for i in keep]
    for out, prompt, adapter in zip(run(llm, prompts, adapters, params), prompts, adapters,
                                    strict=True):
        check(out, prompt, reference(oracle, prompt, adapter))


def test_the_cap_and_the_plain_requests(lora_world):
    llm = lora_world.llm(max_loras=2)
    with pytest.raises(InvalidParam) as err:
        llm.engine.check_request([1, 2, 3], SamplingParams(prompt_logprobs=21))
    assert err.value.param == "prompt_logprobs" and "--max-logprobs" in str(err.value)
    with pytest.raises(InvalidParam) as err:
        llm.engine.check_request([1, 2, 3], SamplingParams(logprobs=21))
    assert err.value.param == "logprobs"
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)
    (plain,) = run(llm, [[5, 6, 7]], [None], SamplingParams(max_tokens=2, temperature=0.0))
    (with_them,) = run(llm, [[5, 6, 7]], [None], params)
    assert plain.prompt_logprobs is None
    assert [e.top for e in with_them.prompt_logprobs[1:]] == [[], []]
    assert out.token_ids[:1] == with_them.new_token_ids  # asking changes nothing generated
