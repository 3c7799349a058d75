"""The Triton kernels against the float64 oracle: under the interpreter on CPU, compiled on CUDA.

The interpreter runs one program at a time, so small shapes with blocks as large as the
problem: every popularity x rank x dtype and every tokens x slots x hidden, the rest drawn.
"""

import importlib

import pytest
import torch
from lora_cases import (
    DTYPES,
    HIDDEN,
    POPULARITIES,
    RANKS,
    SLOTS,
    TOKENS,
    WIDTHS,
    Case,
    covering_cases,
    make_problem,
    run_checks,
)

from loragw.kernels import apply_lora, make_lora_meta
from loragw.kernels.reference import oracle_apply

lt = importlib.import_module("loragw.kernels.lora_triton")
DEVICE = "cpu" if lt.INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="TRITON_INTERPRET is off and there is no CUDA device")

CASES = (covering_cases({"popularity": POPULARITIES, "rank": RANKS, "dtype": DTYPES}, seed=3)
         + covering_cases({"T": TOKENS, "S": SLOTS, "H": HIDDEN}, seed=4))


def test_cases_cover_every_axis_value():
    for field, values in [("widths", WIDTHS), ("mixed_ranks", (False, True))]:
        assert {getattr(c, field) for c in CASES} >= set(values), field


@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_matches_oracle(case):
    problem = make_problem(case, DEVICE)
    meta = make_lora_meta(problem.token_slots, case.S)
    run_checks(problem, case, "triton", meta, shrink_into=lt.lora_shrink)


# Small blocks force every loop and grid axis past one step: several tiles per slot, several
# rank blocks (and programs past a small adapter's rank exiting), a multi-step rank loop in
# expand, several output blocks per slice, and split-K adding into y.
SMALL_BLOCKS = [
    (lt.ShrinkConfig(block_r=16, block_k=16, split_k=1), lt.ExpandConfig(block_n=16, block_r=16)),
    (lt.ShrinkConfig(block_r=32, block_k=32, split_k=4), lt.ExpandConfig(block_n=32, block_r=32)),
]


@pytest.mark.parametrize("shrink_cfg,expand_cfg", SMALL_BLOCKS, ids=["split1", "split4"])
@pytest.mark.parametrize("popularity", ["identical", "uniform"])
def test_small_blocks_and_split_k(shrink_cfg, expand_cfg, popularity):
    case = Case(popularity, rank=64, dtype=torch.float32, T=33, S=4, H=100, widths=(40, 8, 24),
                mixed_ranks=True, seed=7)
    p = make_problem(case, DEVICE)
    meta = make_lora_meta(p.token_slots, case.S, block_m=16)
    shrink = lambda x, a, r, m, y: lt.lora_shrink(x, a, r, m, y, config=shrink_cfg)
    y = torch.zeros(len(case.widths), case.T, case.rank, device=DEVICE)
    shrink(p.x, p.lora_a, p.ranks, meta, y)
    out = p.out0.clone()
    lt.lora_expand(out, y, p.lora_b, p.ranks, p.scales, p.slice_offsets, meta, config=expand_cfg)
    want = oracle_apply(p.out0, p.x, p.lora_a, p.lora_b, p.ranks, p.scales, p.slice_offsets, p.token_slots)
    untouched = p.untouched().to(DEVICE)
    assert torch.equal(out[untouched], p.out0[untouched])
    torch.testing.assert_close(out.double().cpu(), want, atol=1e-4, rtol=1e-4)


def test_strided_x_and_out_views():
    """The engine may hand a column slice of a wider activation/output buffer."""
    case = Case("zipf", rank=16, dtype=torch.float32, T=16, S=4, H=64, widths=(48, 17),
                mixed_ranks=True, seed=8)
    p = make_problem(case, DEVICE)
    meta = make_lora_meta(p.token_slots, case.S)
    x_wide = torch.full((case.T, 80), float("nan"), device=DEVICE)
    x_wide[:, 8:72] = p.x
    out_wide = torch.zeros(case.T, 100, device=DEVICE)
    out_wide[:, 10:75] = p.out0
    apply_lora(out_wide[:, 10:75], x_wide[:, 8:72], p.lora_a, p.lora_b, p.ranks, p.scales,
               p.slice_offsets, meta, backend="triton")
    want = oracle_apply(p.out0, p.x, p.lora_a, p.lora_b, p.ranks, p.scales, p.slice_offsets, p.token_slots)
    torch.testing.assert_close(out_wide[:, 10:75].double().cpu(), want, atol=1e-4, rtol=1e-4)
    assert (out_wide[:, :10] == 0).all() and (out_wide[:, 75:] == 0).all()


def test_grid_depends_only_on_static_sizes():
    """Two steps with the same T and S launch the same grid (CUDA-graph capturable)."""
    metas = [make_lora_meta(torch.tensor(s), num_slots=8) for s in
             ([0] * 40, list(range(8)) * 5, [-1] * 40, [3, -1] * 20)]
    grids = {(lt.shrink_grid(m.tile_slots.shape[0], 3, 64, lt.shrink_config(m.tile_slots.shape[0], 3, 64, 4096, m.block_m)),
              lt.expand_grid(m.tile_slots.shape[0], 3, 4096, lt.expand_config(4096, 64, m.block_m)))
             for m in metas}
    assert len(grids) == 1


@pytest.mark.parametrize("block_m", [1, 4])
def test_tiles_under_16_rows_take_the_gemv_path(block_m):
    """block_m < 16 (one token per program at 1: a BGMV) sums products instead of tl.dot."""
    case = Case("uniform", rank=16, dtype=torch.bfloat16, T=9, S=4, H=64, widths=(40, 8, 8),
                mixed_ranks=True, seed=9)
    p = make_problem(case, DEVICE)
    run_checks(p, case, "triton", make_lora_meta(p.token_slots, case.S, block_m=block_m),
               shrink_into=lt.lora_shrink)


def test_gpu_rules_split_k_only_when_the_grid_is_small():
    decode = lt.shrink_config(num_tiles=1, n_slices=3, max_rank=64, hidden=4096, block_m=16, interpret=False)
    assert (decode.block_r, decode.block_k, decode.split_k) == (16, 256, lt.MAX_SPLIT_K)
    prefill = lt.shrink_config(num_tiles=200, n_slices=3, max_rank=64, hidden=4096, block_m=64, interpret=False)
    assert (prefill.block_r, prefill.split_k) == (64, 1)
    assert lt.shrink_config(1, 1, 64, 256, 16, interpret=False).split_k == 1  # one K block: nothing to split
    assert lt.expand_config(14336, 64, 16, interpret=False) == lt.ExpandConfig(block_n=128, block_r=16)
