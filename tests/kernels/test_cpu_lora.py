"""kernels/cpu_lora.py: the C bag kernel serves the CPU's float32 and bfloat16 decode groups once
built and checked per dtype (its sums are checked against float64 over the kernel grid of
test_kernels_cpu_dispatch.py, strategy "bags", and here over bf16 traffic shapes with the kernel
seen serving), and embedding bags serve otherwise."""

from __future__ import annotations

import pytest
import torch
from lora_cases import POPULARITIES, RANKS, covering_cases, make_problem, run_checks

from loragw.kernels import cpu_dispatch, cpu_lora, make_lora_meta

DTYPES = [torch.float32, torch.bfloat16]


def test_the_kernel_is_checked_and_serves_float32_and_bfloat16_rows():
    x, out = torch.randn(4, 16), torch.zeros(4, 8)
    for dtype in DTYPES:
        assert cpu_lora.self_check(dtype) is None
        assert cpu_lora.usable(out.to(dtype), x.to(dtype))
    assert not cpu_lora.usable(out.half(), x.half())
    assert not cpu_lora.usable(out.bfloat16(), x)  # x and out in one dtype
    assert not cpu_lora.usable(torch.zeros(8, 4).T, x)  # rows not contiguous


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_kernel_that_cannot_build_leaves_the_bags_serving(monkeypatch, caplog, dtype):
    def no_compiler(dtype):
        raise RuntimeError("no C compiler (cc or $CC) to build the lora_bags kernel")

    monkeypatch.setattr(cpu_lora, "_kernel", no_compiler)
    monkeypatch.setattr(cpu_lora, "_checked", cpu_lora._checked.__wrapped__)
    assert not cpu_lora.usable(torch.zeros(4, 8, dtype=dtype), torch.randn(4, 16).to(dtype))
    assert "no C compiler" in caplog.text


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_tokens_delta_does_not_depend_on_the_tokens_walked_beside_it(dtype):
    """Threads walk up to four tokens side by side: every token count (partial groups too), with
    an index of rows, gives each token the bits it gets alone, and float64's sums (bfloat16: to
    the delta's and the sum's roundings)."""
    from loragw.kernels.cpu_dispatch import GatherGroup, _build_tables

    g = torch.Generator().manual_seed(5)
    S, H, edges = 6, 40, (0, 24, 36, 52)
    ranks = torch.randint(0, 9, (3, S), generator=g)
    tables = _build_tables(torch.randn(3, S, 8, H, generator=g),
                           torch.randn(S, 52, 8, generator=g), ranks,
                           torch.rand(3, S, generator=g), edges, ())
    offsets = tuple(zip(edges, edges[1:]))
    for T in (2, 3, 7, 8, 9, 13):
        x = torch.randn(T + 2, H, generator=g).to(dtype)
        base = torch.randn(T + 2, 52, generator=g).to(dtype)
        rows = torch.randperm(T + 2, generator=g)[:T]
        slots = torch.randint(0, S, (T,), generator=g)
        together = base.clone()
        cpu_lora.apply_bags(together, x, tables, [0, 1, 2], offsets,
                            GatherGroup(rows, slots, tuple(range(S)), T))
        alone = base.clone()
        for t in range(T):
            cpu_lora.apply_bags(alone, x, tables, [0, 1, 2], offsets,
                                GatherGroup(rows[t:t + 1], slots[t:t + 1], tuple(range(S)), 1))
        assert torch.equal(together, alone), T
        want = base.double()
        a = tables.a.double().view(S, H, -1)
        for row, slot in zip(rows.tolist(), slots.tolist()):
            y = x[row].double() @ a[slot]
            for i, (lo, hi) in enumerate(offsets):
                c0, c1 = tables.cols[i], tables.cols[i + 1]
                if tables.b[i] is not None:
                    want[row, lo:hi] += y[c0:c1] @ tables.b[i].double().view(S, c1 - c0, -1)[slot]
        tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
        torch.testing.assert_close(together.double(), want, rtol=tol, atol=10 * tol)


BF16_CASES = covering_cases({"popularity": POPULARITIES, "rank": RANKS,
                             "dtype": (torch.bfloat16,)}, seed=7)


@pytest.mark.parametrize("case", BF16_CASES, ids=str)
def test_bf16_traffic_runs_on_the_kernel_and_matches_float64(case, monkeypatch):
    """Every slot down the bags (NaN rank padding, rows without an adapter NaN): the C kernel
    takes each bf16 group, and apply_lora matches the float64 oracle to bf16's tolerance."""
    calls = []
    real = cpu_lora.apply_bags
    monkeypatch.setattr(cpu_lora, "apply_bags", lambda *args: calls.append(args) or real(*args))
    monkeypatch.setattr(cpu_dispatch, "use_per_slot_loop", lambda count, run, small: False)
    problem = make_problem(case)
    meta = make_lora_meta(problem.token_slots, case.S)
    run_checks(problem, case, "torch", meta)  # the pool's bag tables are built on first sight
    adapted = any(int(problem.ranks[:, s].max()) for s in problem.token_slots.tolist() if s >= 0)
    assert bool(calls) == adapted, case
