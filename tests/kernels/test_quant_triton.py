"""The quantized GEMM against the float64 oracle: under the interpreter on CPU, compiled on CUDA.

The grid: every kind x zero points x grouping x act order x dtype (the axes the dequantization
reads, and the dtype W is rounded to), tokens drawn; then every tokens x kind x dtype (the M
tiling and its masks), the rest drawn. Groupings: 32 and 128 columns, one group per row
(channel), and 64 over 201 columns (a partial last group of 9, and an odd I: int4's last byte
carries a padding nibble). Outputs are normalised to about unit size, so one tolerance per
dtype bounds both the rounding of W to x.dtype and of y. Small shapes, blocks as large as the
problem (the interpreter runs one program at a time); a separate test forces small blocks.
"""

import importlib
import random
from dataclasses import dataclass

import pytest
import torch

from loragw.kernels.act_quant import ActQuant
from loragw.kernels.meta import DECODE_MAX_TOKENS
from loragw.kernels.quant import FP8_MIN_CAPABILITY, KINDS, QuantWeight, oracle_linear, pack_int4

qt = importlib.import_module("loragw.kernels.quant_triton")
DEVICE = "cpu" if qt.INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="TRITON_INTERPRET is off and there is no CUDA device")

GROUPINGS = {"g32": (256, 32), "g128": (384, 128), "channel": (160, 160), "partial-odd": (201, 64)}
TOKENS = (1, 5, 33)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# |got - want| <= tol + tol * |want| with |want| ~ 1: a few units of x.dtype's rounding (W is
# rounded to x.dtype, y is rounded once); fp32 leaves room for the fp32 sum over I.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
CODES = {"int4": (-8, 8), "int8": (-128, 128)}    # q's range, as randint's [lo, hi)
LARGEST = {"int4": 15, "int8": 255, "fp8": 448}   # largest |q - z|
O_SLICES = (24, 16)                               # a merged projection's two output slices


@dataclass(frozen=True)
class Case:
    kind: str
    asym: bool
    grouping: str
    act_order: bool
    dtype: torch.dtype
    T: int
    bias: bool
    seed: int

    def __str__(self) -> str:
        return (f"{self.kind}-{'asym' if self.asym else 'sym'}-{self.grouping}"
                f"{'-actorder' if self.act_order else ''}-{str(self.dtype)[6:]}-T{self.T}"
                f"{'-bias' if self.bias else ''}")


def covering(axes: dict[str, tuple], seed: int) -> list[Case]:
    """The product of `axes`; every other axis drawn per case from a seeded generator."""
    every = {"kind": KINDS, "asym": (False, True), "grouping": tuple(GROUPINGS),
             "act_order": (False, True), "dtype": DTYPES, "T": TOKENS, "bias": (False, True)}
    combos: list[dict] = [{}]
    for key, values in axes.items():
        combos = [{**c, key: v} for c in combos for v in values]
    cases = []
    for i, combo in enumerate(combos):
        rng = random.Random(seed * 100_003 + i)
        fields = {k: combo[k] if k in combo else rng.choice(v) for k, v in every.items()}
        cases.append(Case(**fields, seed=seed * 100_003 + i))
    return cases


CASES = (covering({"kind": KINDS, "asym": (False, True), "grouping": tuple(GROUPINGS),
                   "act_order": (False, True), "dtype": DTYPES}, seed=1)
         + covering({"T": TOKENS, "kind": KINDS, "dtype": DTYPES}, seed=2))


def make_weight(kind: str, asym: bool, columns: int, group_size: int, act_order: bool,
                gen: torch.Generator, device: str = DEVICE) -> QuantWeight:
    """Random codes over the kind's whole range; scales that make |W| ~ 1 / sqrt(I)."""
    rows, groups = sum(O_SLICES), -(-columns // group_size)
    if kind == "fp8":  # finite e4m3 values up to +-448, subnormals included
        qweight = (torch.randn(rows, columns, generator=gen) * 64).clamp(-448, 448)
        qweight = qweight.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        q = torch.randint(*CODES[kind], (rows, columns), generator=gen)
        qweight = pack_int4(q) if kind == "int4" else q.to(torch.int8)
    zeros = None
    if asym:  # fp8: no format has zero points, but the layout allows them
        zeros = torch.randint(*CODES.get(kind, (-4, 4)), (rows, groups), generator=gen,
                              dtype=torch.int8)
    scales = (0.5 + torch.rand(rows, groups, generator=gen)) / (LARGEST[kind] * columns ** 0.5)
    g_idx = row_slice = None
    if act_order:  # GPTQ desc_act: each slice's columns in its own order, groups of group_size
        g_idx = torch.stack([torch.randperm(columns, generator=gen) // group_size
                             for _ in O_SLICES]).to(torch.int32)
        row_slice = torch.cat([torch.full((n,), i, dtype=torch.int32)
                               for i, n in enumerate(O_SLICES)])
    w = QuantWeight(kind, qweight, scales, zeros, group_size, columns, g_idx, row_slice)
    w.check()
    return on_device(w, device)


def on_device(w: QuantWeight, device: str) -> QuantWeight:
    move = lambda t: None if t is None else t.to(device)
    return QuantWeight(w.kind, move(w.qweight), move(w.scales), move(w.zeros), w.group_size,
                       w.in_features, move(w.g_idx), move(w.row_slice))


def skip_unsupported(kind: str) -> None:
    if not qt.triton_supports(kind, torch.device(DEVICE)):
        pytest.skip(f"{kind} needs sm_{FP8_MIN_CAPABILITY}+ (the engine dequantizes there)")


def run_case(case: Case, config=None) -> None:
    skip_unsupported(case.kind)
    gen = torch.Generator().manual_seed(case.seed)
    columns, group_size = GROUPINGS[case.grouping]
    w = make_weight(case.kind, case.asym, columns, group_size, case.act_order, gen)
    x = torch.randn(case.T, columns, generator=gen).to(case.dtype).to(DEVICE)
    bias = torch.randn(w.out_features, generator=gen).to(case.dtype).to(DEVICE) if case.bias else None
    y = qt.quant_matmul(x, w, bias, config=config)
    assert y.shape == (case.T, w.out_features) and y.dtype == case.dtype
    tol = TOLERANCE[case.dtype]
    torch.testing.assert_close(y.double().cpu(), oracle_linear(x, w, bias).cpu(), atol=tol, rtol=tol)


def test_cases_cover_every_axis_value():
    assert {c.bias for c in CASES} == {False, True}
    # act order's per-row g_idx gather meets every M tiling, with and without it
    assert {(c.T, c.act_order) for c in CASES} == {(T, a) for T in TOKENS for a in (False, True)}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_quant_matmul_matches_oracle(case):
    run_case(case)


# 16 x 16 x 64 blocks over T = 129, O = 40, I = 201 in groups of 48: nine M tiles (a program
# group of GROUP_M, then a group of one), three N blocks (the last partial), four K steps (the
# last partial), group boundaries inside K tiles, and act order's g_idx gathered across them.
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("asym,act_order", [(False, False), (True, True)], ids=["sym", "asym-actorder"])
def test_small_blocks(kind, asym, act_order):
    skip_unsupported(kind)
    gen = torch.Generator().manual_seed(5)
    w = make_weight(kind, asym, 201, 48, act_order, gen)
    x = torch.randn(129, 201, generator=gen).to(DEVICE)
    cfg = qt.QuantConfig(block_m=16, block_n=16, block_k=64)
    assert qt.quant_grid(129, 40, cfg) == (9 * 3,) and qt.GROUP_M == 8
    y = qt.quant_matmul(x, w, config=cfg)
    torch.testing.assert_close(y.double().cpu(), oracle_linear(x, w).cpu(), atol=1e-5, rtol=1e-5)


# W8A8 / FP8 schemes: x quantized first (per token, per group, or a static scale per merged
# slice, O_SLICES' two with different scales), then the kernel on x_hat: the oracle's meaning.
ACTS = {"int8-token": ActQuant("int8", True), "fp8-group32-asym": ActQuant(
    "fp8", True, False, group_size=32), "static-per-slice": ActQuant(
    "int8", False, scales=torch.tensor([0.02, 0.05]), rows=O_SLICES)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_quantized_activations(act, dtype):
    kind = "int8" if act != "fp8-group32-asym" else "fp8"
    skip_unsupported(kind)
    gen = torch.Generator().manual_seed(8)
    w = make_weight(kind, False, 256, 32, False, gen)
    w.act = ACTS[act].to(torch.device(DEVICE))
    w.check()
    x = torch.randn(5, 256, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(w.out_features, generator=gen).to(dtype).to(DEVICE)
    y = qt.quant_matmul(x, w, bias)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(y.double().cpu(), oracle_linear(x, w, bias).cpu(), atol=tol,
                               rtol=tol)


def test_every_finite_fp8_code():
    """Each e4m3 code but the two NaNs, one per output row, times x = 1: y is the code's value."""
    skip_unsupported("fp8")
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    w = QuantWeight("fp8", codes[:, None].to(DEVICE), torch.ones(len(codes), 1, device=DEVICE),
                    None, 1, 1)
    y = qt.quant_matmul(torch.ones(1, 1, device=DEVICE), w)
    assert torch.equal(y[0].cpu(), codes.view(torch.float8_e4m3fn).float())


def test_strided_x():
    """The engine may hand a column slice of a wider activation buffer."""
    gen = torch.Generator().manual_seed(6)
    w = make_weight("int4", True, 201, 64, False, gen)
    x_wide = torch.full((5, 260), float("nan"), dtype=torch.float16, device=DEVICE)
    x_wide[:, 30:231] = torch.randn(5, 201, generator=gen).to(torch.float16).to(DEVICE)
    y = qt.quant_matmul(x_wide[:, 30:231], w)
    torch.testing.assert_close(y.double().cpu(), oracle_linear(x_wide[:, 30:231], w).cpu(),
                               atol=4e-3, rtol=4e-3)


def test_no_tokens():
    w = make_weight("int8", False, 64, 32, False, torch.Generator().manual_seed(7))
    assert qt.quant_matmul(torch.empty(0, 64, device=DEVICE), w).shape == (0, 40)


def test_gpu_rules_decode_and_prefill_tiles():
    decode = qt.quant_config(1, 4096, 4096, interpret=False)
    assert decode == qt.quant_config(DECODE_MAX_TOKENS, 4096, 4096, interpret=False)
    assert decode == qt.QuantConfig(block_m=16, block_n=16, block_k=128, num_warps=4)
    assert qt.quant_grid(1, 4096, decode) == (256,)   # ~2 programs per SM of an H100 for a GEMV
    prefill = qt.quant_config(DECODE_MAX_TOKENS + 1, 4096, 4096, interpret=False)
    assert prefill == qt.QuantConfig(block_m=64, block_n=128, block_k=32, num_warps=8)


def test_fp8_needs_sm89(monkeypatch):
    cuda = torch.device("cuda", 0)
    for capability, fp8 in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=capability: c)
        assert qt.triton_supports("fp8", cuda) is fp8
        assert qt.triton_supports("int4", cuda) and qt.triton_supports("int8", cuda)
    assert qt.triton_supports("fp8", torch.device("cpu"))   # the interpreter decodes e4m3 itself
