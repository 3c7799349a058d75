"""Greedy output equals transformers `generate`, token for token, for every supported
architecture and under every scheduling stress: batching, chunked prefill, queueing, preemption."""

import pytest
import torch
from peft_reference import hf_greedy
from transformers import AutoModelForCausalLM

from loragw.engine import LLM, SamplingParams

MAX_TOKENS = 20
VARIANTS = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-rope-llama3": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-head-dim": ("llama", {"head_dim": 24}),
    "llama-sharded": ("llama", {"sharded": True}),
}
SCHEDULES = {
    "batched": {},
    "chunked-prefill": {"max_num_batched_tokens": 8},
    "queued": {"max_num_seqs": 2},
    "preempted": {"num_kv_blocks": 24, "block_size": 4},
    # every projection through oneDNN's packed GEMM (auto packs only large ones)
    "onednn": {"linear_backend": "onednn"},
}


def make_prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in (1, 5, 17, 40, 3, 29)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(tiny_checkpoint, variant):
    arch, overrides = VARIANTS[variant]
    path = tiny_checkpoint(arch, **overrides)
    vocab = AutoModelForCausalLM.from_pretrained(path).config.vocab_size
    prompts = make_prompts(vocab)
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    assert len({tuple(e) for e in expected}) > 1, "degenerate checkpoint: every output is equal"
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for name, schedule in SCHEDULES.items():
        llm = LLM(path, device="cpu", dtype="float32", **schedule)
        outputs = llm.generate(prompts, params)
        for prompt, out, ref in zip(prompts, outputs, expected):
            assert out.token_ids == ref, f"{variant}/{name}: prompt of {len(prompt)} tokens differs"
            assert out.finish_reason == "length"
        engine = llm.engine
        assert engine.num_free_kv_blocks == engine.block_manager.num_blocks, "leaked KV blocks"
        if name == "preempted":
            assert engine.scheduler.num_preemptions > 0, "the schedule did not force preemption"
