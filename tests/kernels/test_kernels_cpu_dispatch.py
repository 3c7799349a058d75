"""The CPU production path's split of a step (per-slot loop vs one group of per-token bags)
and the bag tables it reads (kernels/cpu_dispatch.py)."""

import pytest
import torch
from lora_cases import DTYPES, POPULARITIES, RANKS, covering_cases, make_problem, run_checks
from torch.utils._python_dispatch import TorchDispatchMode

from loragw.kernels import apply_lora, cpu_dispatch, make_lora_meta, reference
from loragw.kernels.cpu_dispatch import (
    GATHER_MIN_SLOTS,
    LOOP_MIN_RUN,
    TABLES_STABLE_CALLS,
    bag_tables,
    make_step_plan,
    step_plan,
    use_per_slot_loop,
)


def test_rule_loops_prefill_chunks_and_groups_the_rest():
    assert use_per_slot_loop(512, contiguous=True, num_small_slots=3)      # a prefill chunk
    assert not use_per_slot_loop(LOOP_MIN_RUN - 1, contiguous=True, num_small_slots=2)
    assert not use_per_slot_loop(512, contiguous=False, num_small_slots=2)  # popular, decoding
    assert not use_per_slot_loop(1, contiguous=True, num_small_slots=32)   # distinct adapters
    assert not use_per_slot_loop(1, contiguous=True, num_small_slots=1)  # alone: a bag too
    assert GATHER_MIN_SLOTS == 1


def test_plan_loops_a_prefill_chunk_and_groups_the_decode_rows():
    # rows 0-2: decode on slots 3, 1, 5; row 3: no adapter; then a prefill chunk on slot 2
    slots = torch.tensor([3, 1, 5, -1] + [2] * LOOP_MIN_RUN)
    plan = make_step_plan(make_lora_meta(slots, num_slots=6))
    assert [(item.slot, item.rows) for item in plan.loop] == [(2, slice(4, 4 + LOOP_MIN_RUN))]
    group = plan.gather
    assert group.rows.tolist() == [1, 0, 2] and group.slots.tolist() == [1, 3, 5]
    assert group.slot_list == (1, 3, 5) and group.num_tokens == 3
    assert group.bag_index(4).tolist()[0] == [4, 5, 6, 7]  # slot 1, four rows per slot


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
    make_lora_meta(torch.tensor([3, 3, 3]), num_slots=4, out=meta)  # refilled in place
    assert step_plan(meta) is not plan and step_plan(meta).gather.slot_list == (3,)


CASES = covering_cases({"popularity": POPULARITIES, "rank": RANKS, "dtype": DTYPES}, seed=3)


@pytest.mark.parametrize("strategy", ["loop", "bags", "gather-bmm"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_strategy_alone_matches_oracle(case, strategy, monkeypatch):
    """Forced down one path for every slot, over the poisoned grid (NaN rank padding)."""
    loop = strategy == "loop"
    monkeypatch.setattr(cpu_dispatch, "use_per_slot_loop", lambda count, run, small: loop)
    if strategy == "gather-bmm":  # what pools without a version counter get
        monkeypatch.setattr(reference, "bag_tables", lambda *args: None)
    problem = make_problem(case)
    meta = make_lora_meta(problem.token_slots, case.S)
    plan = step_plan(meta)
    assert not (plan.gather if loop else plan.loop)
    run_checks(problem, case, "torch", meta)


def pool(S=4, R=8, H=16, widths=(12, 6)):
    offsets = (0, widths[0], sum(widths))
    return dict(lora_a=torch.randn(len(widths), S, R, H), lora_b=torch.randn(S, offsets[-1], R),
                ranks=torch.full((len(widths), S), R, dtype=torch.int32),
                scales=torch.ones(len(widths), S), slice_offsets=offsets)


def test_bag_tables_are_rebuilt_once_a_written_pool_settles():
    p = pool()
    tables = bag_tables(**p)
    assert tables is not None and bag_tables(**p) is tables
    p["lora_b"][2, :, :3].copy_(torch.randn(18, 3))  # what LoRAManager._fill does
    for _ in range(TABLES_STABLE_CALLS - 1):
        assert bag_tables(**p) is None  # the gather-bmm serves meanwhile
    p["ranks"][1, 0] = 4  # another fill: the count starts again
    for _ in range(TABLES_STABLE_CALLS - 1):
        assert bag_tables(**p) is None
    rebuilt = bag_tables(**p)
    assert rebuilt is not None and rebuilt is not tables and bag_tables(**p) is rebuilt


def test_new_weights_in_a_slot_are_served_at_once():
    p = pool()
    meta = make_lora_meta(torch.tensor([0, 1, 2, 3]), 4)
    x = torch.randn(4, 16)
    before = torch.zeros(4, 18)
    apply_lora(before, x, **p, meta=meta)
    p["lora_a"][:, 2].mul_(-1.0)  # slot 2 now holds other weights
    for _ in range(TABLES_STABLE_CALLS + 1):  # the gather-bmm, then rebuilt tables
        after = torch.zeros(4, 18)
        apply_lora(after, x, **p, meta=meta)
        torch.testing.assert_close(after[2], -before[2])
        torch.testing.assert_close(after[[0, 1, 3]], before[[0, 1, 3]])


def test_inference_tensor_pools_fall_back_to_gather_bmm():
    with torch.inference_mode():
        p = pool()
    assert bag_tables(**p) is None
    meta = make_lora_meta(torch.tensor([0, 1, 2, 3]), 4)
    out, x = torch.zeros(4, 18), torch.randn(4, 16)
    with torch.inference_mode():
        apply_lora(out, x, **p, meta=meta)
    want = reference.oracle_apply(torch.zeros(4, 18), x, **p, token_slots=meta.token_slots)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)


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
    want = reference.oracle_apply(torch.zeros(4, 12), *args[:-1], token_slots=meta.token_slots)
    with torch.inference_mode():
        inside = torch.zeros(4, 12)
        apply_lora(inside, *args)
    out = torch.zeros(4, 12)
    apply_lora(out, *args)
    assert out.abs().sum() > 0
    for got in (inside, out):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
