"""Greedy parity with transformers under the schedules that stress a sliding window (batching,
chunked prefill, preemption with blocks handed back): shared by test_sliding_window and
test_gemma. Prompts up to 40 tokens, longer than the tiny checkpoints' 8-token windows."""

import torch
from peft_reference import hf_greedy

from loragw.engine import LLM, SamplingParams

MAX_TOKENS = 20
WINDOW = 8
SCHEDULES = {
    "batched": {},
    "chunked-prefill": {"max_num_batched_tokens": 8},
    "preempted": {"num_kv_blocks": 30, "block_size": 2},  # tight even with blocks freed
}
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def make_prompts(vocab_size: int, lengths=(1, 5, 17, 40, 3, 29)) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def check_schedules(path: str, label: str, diverse: bool = True,
                    schedules: tuple[str, ...] = tuple(SCHEDULES)) -> None:
    """Greedy engine output equals transformers' under `schedules` (of SCHEDULES), leaking no
    block; `diverse`: the checkpoint's outputs wander over many tokens (parity means something)."""
    prompts = make_prompts(500)
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    if diverse:
        assert len({t for e in expected for t in e}) > 30, "degenerate checkpoint"
    for name in schedules:
        schedule = SCHEDULES[name]
        llm = LLM(path, device="cpu", dtype="float32", **schedule)
        for prompt, out, ref in zip(prompts, llm.generate(prompts, GREEDY), expected):
            assert out.token_ids == ref, f"{label}/{name}: prompt of {len(prompt)} tokens differs"
        engine = llm.engine
        assert engine.num_free_kv_blocks == engine.block_manager.num_blocks, "leaked KV blocks"
        if name == "preempted":
            assert engine.scheduler.num_preemptions > 0, "the schedule did not force preemption"
