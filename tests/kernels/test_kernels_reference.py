"""The torch backend (the CPU production path) against the float64 oracle, over the full grid."""

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
    covering_cases,
    make_problem,
    run_checks,
)

from loragw.kernels import make_lora_meta, reference

# Every popularity x rank x dtype, and every tokens x slots x hidden x widths; the rest drawn.
CASES = (covering_cases({"popularity": POPULARITIES, "rank": RANKS, "dtype": DTYPES}, seed=1)
         + covering_cases({"T": TOKENS, "S": SLOTS, "H": HIDDEN, "widths": WIDTHS}, seed=2))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_torch_backend_matches_oracle(case):
    problem = make_problem(case)
    meta = make_lora_meta(problem.token_slots, case.S)
    run_checks(problem, case, "torch", meta, shrink_into=reference.lora_shrink)


def test_torch_backend_does_rank_r_work_only():
    """A rank-8 adapter in a rank-64 pool multiplies by [8, H], not [64, H]."""
    calls = []
    x = torch.randn(5, 32)
    a = torch.randn(1, 2, 64, 32)
    ranks = torch.tensor([[8, 0]], dtype=torch.int32)
    meta = make_lora_meta(torch.tensor([0, 1, 0, -1, 0]), 2)

    class Spy(torch.Tensor):
        def __matmul__(self, other):
            calls.append(tuple(other.shape))
            return super().__matmul__(other)

    y = torch.zeros(1, 5, 64)
    reference.lora_shrink(x.as_subclass(Spy), a, ranks, meta, y)
    assert calls == [(32, 8)], "slot 0 (rank 8) does one [3, 32] @ [32, 8]; slot 1 (rank 0) nothing"
