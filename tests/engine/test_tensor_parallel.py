"""Tensor parallelism on the CPU (gloo, two ranks, three for one shape): greedy output equals one rank's and PEFT's,
for the Llama family's variants, with mixed-adapter batches, vocabulary LoRAs, chunked
prefill, preemption and adapter churn; every rank holds the same slot table after each batch.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import make_tiny_checkpoint
from peft_reference import MAX_TOKENS, World

from loragw.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow  # two gloo ranks per engine

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 60)), [100] * 17]
VOCAB_LORAS = {
    "embed-head-qv": dict(r=8, lora_alpha=16, target_modules=["embed_tokens", "lm_head",
                                                              "q_proj", "v_proj"]),
    "head-all": dict(r=4, lora_alpha=4, use_rslora=True,
                     target_modules=["lm_head", "q_proj", "k_proj", "v_proj", "o_proj",
                                     "gate_proj", "up_proj", "down_proj"]),
    "mlp-r32": dict(r=32, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


def assert_ranks_agree(llm: LLM) -> None:
    """Every worker rank compares its slot table with rank 0's after each slot change (a
    difference ends it: engine/parallel/runner.py), so all alive means all agreed."""
    runner = llm.engine.runner
    assert len(runner.workers) == 1
    runner.check_ranks()


@pytest.fixture(scope="module")
def vocab_world(tmp_path_factory) -> World:
    return World(str(tmp_path_factory.mktemp("tp-vocab")), VOCAB_LORAS, prompt_seed=5)


def test_mixed_adapters_match_peft_under_chunked_prefill_and_preemption(lora_world: World):
    """Six adapters (ranks 1-16, all targets, rslora, patterns) and base rows in one batch;
    a 24-token budget chunks every prompt, 12 KV blocks preempt."""
    llm = lora_world.llm(tensor_parallel_size=2, max_num_batched_tokens=24, num_kv_blocks=12)
    outputs = llm.generate(lora_world.prompts, GREEDY, adapters=lora_world.requests)
    lora_world.check(outputs, "tp=2")
    assert llm.engine.scheduler.num_preemptions > 0
    assert_ranks_agree(llm)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.usefixtures("every_draft")  # the draft model is the base itself: it never pays
def test_speculative_decoding_matches_peft(lora_world: World, method):
    """Drafts (prompt lookup; a draft model, the base itself, unsplit on rank 0) verified in
    the same mixed, chunked, preempting batches: every rank computes the drafted rows of the
    plan it is sent."""
    spec = {"method": method, "num_speculative_tokens": 3, "disable_by_batch_size": 64}
    spec |= {"prompt_lookup_min": 1} if method == "ngram" else {"model": lora_world.base}
    llm = lora_world.llm(tensor_parallel_size=2, max_num_batched_tokens=24, num_kv_blocks=12,
                         speculative_config=spec)
    outputs = llm.generate(lora_world.prompts, GREEDY, adapters=lora_world.requests)
    lora_world.check(outputs, "tp=2 with speculation")
    assert sum(c.draft_tokens for c in llm.engine.speculator.counts.values()) > 0
    assert_ranks_agree(llm)


def test_vocabulary_loras_and_rank_32_match_peft(vocab_world: World):
    llm = vocab_world.llm(tensor_parallel_size=2, max_lora_rank=32)
    outputs = llm.generate(vocab_world.prompts, GREEDY, adapters=vocab_world.requests)
    vocab_world.check(outputs, "tp=2 embed_tokens / lm_head LoRA")
    assert_ranks_agree(llm)


def test_adapters_loaded_evicted_and_replaced_while_serving(lora_world: World, qv_replacement):
    """Two slots for six adapters: every batch evicts and loads; then one is replaced. The
    ranks' slot tables are compared after every step."""
    llm = lora_world.llm(tensor_parallel_size=2, max_loras=2)
    step, steps = llm.engine.step, []

    def checked_step():
        out = step()
        assert_ranks_agree(llm)
        steps.append(1)
        return out

    llm.engine.step = checked_step
    for _ in range(2):
        outputs = llm.generate(lora_world.prompts, GREEDY, adapters=lora_world.requests)
        lora_world.check(outputs, "tp=2, 2 slots")
        assert_ranks_agree(llm)
    llm.add_adapter("qv-r16", qv_replacement.path)
    rows = lora_world.rows("qv-r16")
    outputs = llm.generate([lora_world.prompts[i] for i in rows], GREEDY,
                           adapters=["qv-r16"] * len(rows))
    assert [o.token_ids for o in outputs] == qv_replacement.expected
    assert len(steps) > 10


@pytest.mark.parametrize("arch, overrides, ranks", [
    ("llama", {}, 2),
    ("llama", {"num_key_value_heads": 1}, 2),  # fewer KV heads than ranks: replicated
    ("qwen2", {}, 2),                          # q/k/v biases
    ("qwen3", {}, 2),                          # q/k norms, head_dim of its own
    # 3 KV heads over 3 ranks, a 512-token vocabulary padded to 3 x 171 rows, tied lm_head
    ("qwen3", {"num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 96,
               "tie_word_embeddings": True}, 3),
], ids=["llama", "llama-kv1", "qwen2", "qwen3", "qwen3-kv3-tied-tp3"])
def test_architectures_match_one_rank(tmp_path, arch, overrides, ranks):
    path = make_tiny_checkpoint(str(tmp_path), arch, **overrides)
    want = [o.token_ids for o in LLM(path, device="cpu").generate(PROMPTS, GREEDY)]
    got = [o.token_ids for o in LLM(path, device="cpu", tensor_parallel_size=ranks,
                                    max_num_batched_tokens=16).generate(PROMPTS, GREEDY)]
    assert got == want


def test_what_cannot_be_split_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="max_full_module_slots must be 0 with "
                                         "tensor_parallel_size > 1"):
        LLM(tiny_checkpoint("llama"), device="cpu", tensor_parallel_size=2,
            max_full_module_slots=1)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by "
                                         "--tensor-parallel-size 3"):
        LLM(tiny_checkpoint("llama"), device="cpu", tensor_parallel_size=3)


def test_an_llm_is_built_again_and_again_and_closed_by_its_with(tiny_checkpoint):
    """`llm = LLM(..., tensor_parallel_size=2)` twice in a row in one process (the second closes
    the first, which then refuses to run: torch.distributed has one default group), and
    `with LLM(...) as llm:` stops its workers and leaves the group when the block ends."""
    path = tiny_checkpoint("llama")
    want = [o.token_ids for o in LLM(path, device="cpu").generate(PROMPTS, GREEDY)]
    llm = LLM(path, device="cpu", tensor_parallel_size=2)
    first = llm
    llm = LLM(path, device="cpu", tensor_parallel_size=2)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert not any(worker.is_alive() for worker in first.engine.runner.workers)
    with pytest.raises(RuntimeError, match="closed"):
        first.generate(PROMPTS, GREEDY)
    with LLM(path, device="cpu", tensor_parallel_size=2) as again:
        assert [o.token_ids for o in again.generate(PROMPTS, GREEDY)] == want
    assert not any(worker.is_alive() for worker in again.engine.runner.workers)
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="closed"):
        again.generate(PROMPTS, GREEDY)
