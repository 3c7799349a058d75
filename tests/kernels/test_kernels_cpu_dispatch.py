"""The CPU production path's split of a step: per-slot loop vs one gather-bmm (cpu_dispatch)."""

import pytest
import torch
from lora_cases import DTYPES, POPULARITIES, RANKS, covering_cases, make_problem, run_checks
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import apply_lora, cpu_dispatch, make_lora_meta
from kernels.cpu_dispatch import (
    GATHER_MIN_SLOTS,
    LOOP_MIN_TOKENS,
    make_step_plan,
    step_plan,
    use_per_slot_loop,
)


def test_rule_loops_busy_slots_and_gathers_many_small_ones():
    assert use_per_slot_loop(512, num_small_slots=0)              # prefill chunk
    assert use_per_slot_loop(LOOP_MIN_TOKENS, num_small_slots=31)  # a popular adapter
    assert not use_per_slot_loop(1, num_small_slots=32)           # decode, distinct adapters
    assert not use_per_slot_loop(LOOP_MIN_TOKENS - 1, num_small_slots=GATHER_MIN_SLOTS)
    assert use_per_slot_loop(1, num_small_slots=GATHER_MIN_SLOTS - 1)  # too few to batch


def test_plan_loops_a_prefill_chunk_and_gathers_the_decode_rows():
    # rows 0-2: decode on slots 3, 1, 5; row 3: no adapter; rows 4-11: a prefill chunk on slot 1
    slots = torch.tensor([3, 1, 5, -1] + [2] * 8)
    plan = make_step_plan(make_lora_meta(slots, num_slots=6))
    assert [(item.slot, item.rows) for item in plan.loop] == [(2, slice(4, 12))]
    group = plan.gather
    assert group.rows.tolist() == [1, 0, 2] and group.slots.tolist() == [1, 3, 5]
    assert group.slot_list == (1, 3, 5) and group.num_tokens == 3


def test_plan_of_an_all_decode_step_reads_x_in_place():
    plan = make_step_plan(make_lora_meta(torch.tensor([4, 0, 2, 1]), num_slots=8))
    assert plan.loop == () and plan.gather.rows == slice(None)
    assert plan.gather.slots.tolist() == [4, 0, 2, 1]


def test_plan_is_built_once_per_step():
    meta = make_lora_meta(torch.tensor([0, 1, 2]), num_slots=4)
    assert step_plan(meta) is step_plan(meta)
    other = make_lora_meta(torch.tensor([0, 1, 2]), num_slots=4)
    assert step_plan(other) is not step_plan(meta)
    plan = step_plan(meta)
    meta.copy_(make_lora_meta(torch.tensor([3, 3, 3]), num_slots=4))  # refilled in place
    assert step_plan(meta) is not plan and step_plan(meta).loop[0].slot == 3


CASES = covering_cases({"popularity": POPULARITIES, "rank": RANKS, "dtype": DTYPES}, seed=3)


@pytest.mark.parametrize("strategy", ["loop", "gather"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_strategy_alone_matches_oracle(case, strategy, monkeypatch):
    """Forced down one path for every slot, over the poisoned grid (NaN rank padding)."""
    loop = strategy == "loop"
    monkeypatch.setattr(cpu_dispatch, "use_per_slot_loop", lambda count, num_small: loop)
    problem = make_problem(case)
    meta = make_lora_meta(problem.token_slots, case.S)
    plan = step_plan(meta)
    assert not (plan.gather if loop else plan.loop)
    run_checks(problem, case, "torch", meta)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def decode_ops(num_adapters: int) -> int:
    """aten ops one qkv-like projection runs for a decode step of distinct adapters."""
    S, R, H, widths = 32, 16, 64, (64, 32, 32)
    offsets = (0, 64, 96, 128)
    meta = make_lora_meta(torch.arange(num_adapters), S)
    args = (torch.zeros(num_adapters, sum(widths)), torch.randn(num_adapters, H),
            torch.randn(len(widths), S, R, H), torch.randn(S, sum(widths), R),
            torch.full((len(widths), S), R, dtype=torch.int32), torch.ones(len(widths), S))
    apply_lora(*args, offsets, meta)  # builds the step's plan, sizes the workspace
    with CountOps() as ops:
        apply_lora(*args, offsets, meta)
    return ops.count


def test_decode_op_count_does_not_grow_with_distinct_adapters():
    assert decode_ops(32) == decode_ops(GATHER_MIN_SLOTS) < 100  # the per-slot loop: ~1,500


def test_workspace_made_in_inference_mode_serves_calls_outside_it(monkeypatch):
    """The engine runs under inference_mode; kernel tests and tools call apply_lora outside."""
    monkeypatch.setattr(cpu_dispatch, "_workspace", cpu_dispatch._Workspace())
    meta = make_lora_meta(torch.arange(4), 4)
    args = (torch.randn(4, 16), torch.randn(1, 4, 8, 16), torch.randn(4, 12, 8),
            torch.full((1, 4), 8, dtype=torch.int32), torch.ones(1, 4), (0, 12), meta)
    with torch.inference_mode():
        apply_lora(torch.zeros(4, 12), *args)
    out = torch.zeros(4, 12)
    apply_lora(out, *args)
    assert out.abs().sum() > 0
