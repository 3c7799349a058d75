"""LoRA on embed_tokens and lm_head: mixed batches give exactly PEFT's greedy tokens.

Adapters saved by PEFT itself that adapt only embed_tokens, only lm_head, or both plus q/v
(with rank/alpha patterns on them), batched with ordinary adapters and base-model rows, on
an untied base and on one with tie_word_embeddings (where lm_head's LoRA is its own, or, with
ensure_weight_tying, the embedding LoRA transposed). The oracle is PEFT (tests/engine/
peft_reference.py), one greedy generate per request, float32 on CPU.
"""

import pytest
from lora_steps import watch_lora_steps
from peft_reference import ALL_SEVEN, MAX_TOKENS, World, needs_triton

from loragw.engine import LLM, SamplingParams

ADAPTERS = {
    "embed-r4": dict(r=4, lora_alpha=8, target_modules=["embed_tokens"]),
    "head-r8": dict(r=8, lora_alpha=16, target_modules=["lm_head"]),
    "embed-head-qv": dict(r=16, lora_alpha=16, use_rslora=True,
                          target_modules=["embed_tokens", "lm_head", "q_proj", "v_proj"],
                          rank_pattern={"embed_tokens": 2}, alpha_pattern={"lm_head": 4}),
    "qv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all-r2": dict(r=2, lora_alpha=4, target_modules=ALL_SEVEN),
}
TIED_ADAPTERS = {
    "embed-head-q": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "q_proj"]),
    "head-r8": dict(r=8, lora_alpha=16, target_modules=["lm_head"]),
    "qv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
}
# PEFT's tied-adapter mode: lm_head's LoRA is embed_tokens' LoRA transposed (saved separately:
# ensure_weight_tying rewrites the config's targets).
WEIGHT_TYING = {"tied-embed-v": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "v_proj"],
                                     ensure_weight_tying=True)}
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return World(str(tmp_path_factory.mktemp("lora-embeddings")), ADAPTERS)


@pytest.fixture(scope="module")
def tied_world(tmp_path_factory) -> World:
    return World(str(tmp_path_factory.mktemp("lora-embeddings-tied")), TIED_ADAPTERS, tied=True,
                 first=WEIGHT_TYING)


ENGINES = {
    "torch": dict(lora_backend="torch"),
    # chunked prefill: rows that do not sample share steps with rows that do
    "torch-2-slots-chunked": dict(lora_backend="torch", max_loras=2, max_num_batched_tokens=8),
    "triton": dict(lora_backend="triton"),
    "triton-2-slots-chunked": dict(lora_backend="triton", max_loras=2, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_mixed_batch_matches_peft(world, engine):
    needs_triton(ENGINES[engine])
    llm = world.llm(**ENGINES[engine])
    world.check(llm.generate(world.prompts, GREEDY, adapters=world.requests), engine)
    assert llm.engine.lora.slots_in_use == 0


@pytest.mark.parametrize("engine", ["torch-2-slots-chunked", "triton"])
def test_tied_embeddings_match_peft(tied_world, engine):
    """A tied base: lm_head LoRA over the shared weight, and PEFT's ensure_weight_tying mode."""
    needs_triton(ENGINES[engine])
    llm = tied_world.llm(**ENGINES[engine])
    tied_world.check(llm.generate(tied_world.prompts, GREEDY, adapters=tied_world.requests),
                     f"tied {engine}")


def test_each_request_alone_equals_batched(world):
    llm = world.llm(lora_backend="torch", max_loras=2)
    for i, (prompt, adapter) in enumerate(zip(world.prompts, world.requests, strict=True)):
        alone = llm.generate([prompt], GREEDY, adapters=[adapter])[0]
        assert alone.token_ids == world.expected[i], f"request {i} ({adapter}) alone"


def test_adapters_without_vocabulary_targets_cost_nothing(world, monkeypatch):
    """No vocabulary-sized buffers until an adapter needs them, and no embed_tokens / lm_head
    LoRA work in steps whose rows' adapters do not adapt them."""
    S, R, V, H = 2, 16, 256, 64
    llm = LLM(world.base, device="cpu", dtype="float32", max_loras=S, max_lora_rank=R,
              lora_backend="torch")
    lora = llm.engine.lora
    for name in ("qv-r8", "all-r2"):
        llm.add_adapter(name, world.dirs[name])
    assert lora.device_bytes["embed_tokens"] == lora.device_bytes["lm_head"] == 0
    assert lora.device_bytes["projections"] > 0

    steps = watch_lora_steps(llm, monkeypatch)
    ordinary = [i for i, a in enumerate(world.requests) if a in ("qv-r8", "all-r2", None)]
    prompts = [world.prompts[i] for i in ordinary]
    adapters = [world.requests[i] for i in ordinary]
    want = [world.expected[i] for i in ordinary]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, adapters=adapters)] == want
    assert steps and all(not s.embed and s.sample is None for s in steps if s is not None)

    llm.add_adapter("embed-head-qv", world.dirs["embed-head-qv"])  # one slot each, like A and B
    assert lora.device_bytes["embed_tokens"] == S * R * (V + H) * 4 + S * 8
    assert lora.device_bytes["lm_head"] == S * R * (H + V) * 4 + S * 8
    steps.clear()
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, adapters=adapters)] == want
    assert all(not s.embed and s.sample is None for s in steps if s is not None)

    steps.clear()
    i = world.requests.index("embed-head-qv")
    mixed = llm.generate([world.prompts[i], prompts[0]], GREEDY,
                         adapters=["embed-head-qv", adapters[0]])
    assert [o.token_ids for o in mixed] == [world.expected[i], want[0]]
    assert steps and all(s.embed and s.sample is not None for s in steps)
