"""A quantized projection on the CPU in C (kernels/csrc/quant_gemm.c, built by kernels/native.py),
reading kernels/quant.py's layout as it is held and dequantizing in registers as it multiplies,
where `dequant_linear` first writes the whole float32 weight (4-8x the bytes it read), then
reads it back through F.linear.

    y = quant_linear(x, w, bias) = x_hat @ dequantize(w).T (+ bias)
    x: [..., I] (float32; another dtype is computed in float32 and cast back)   w: QuantWeight,
    every kind (int4, int8, fp8), group or channel scales, zero points, act order   bias: [O]
    or None   y: [..., O] in x.dtype   x_hat: x quantized as w.act declares (W8A8 / FP8
    schemes: kernels/act_quant.py, in torch first, as dequant_linear does), else x

Each weight element is `dequantize`'s float32, bit for bit, so y is dequant_linear's in float32
but for the order of the sums. A decode batch (`use_direct`) multiplies each dequantized vector
into every token's accumulators while it is in registers; larger batches dequantize a tile
into L1 once and run a small GEMM of all tokens over it. Act-order weights dequantize one
element at a time (correct, not fast). Serves once `self_check` passed (engine/forward/
backends.py); otherwise dequantize-then-GEMM does.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from loragw.kernels import native
from loragw.kernels.act_quant import linear_with_input_quant
from loragw.kernels.quant import KINDS, QuantWeight, dequantize, oracle_linear, pack_int4

SIGNATURE = ("plplp" "iiii" "pl" "ppii" "ppi", "i")  # quant_gemm_f32's argument and return codes
KIND_CODES = {kind: code for code, kind in enumerate(KINDS)}  # quant_gemm.c's enum
# Up to this many tokens, dequantizing each unit in registers once per 4 tokens beats
# dequantizing a tile into L1 once for all (gate_up 2752 x 512 int4 g32, one Zen 3 core: T = 4
# direct 0.26 ms vs tiled 0.38; T = 6 0.47 vs 0.46; T = 8 0.54 vs 0.54; int8 and fp8 alike).
DIRECT_MAX_TOKENS = 4
TOLERANCE = 1e-5  # |y - oracle| / (|x| @ |W|.T + |bias|): float32 sums of a few hundred terms


@functools.cache
def _kernel():
    return native.function("quant_gemm", "quant_gemm_f32", *SIGNATURE)


def use_direct(tokens: int) -> bool:
    """Whether `tokens` rows take the register path rather than the tiled one."""
    return tokens <= DIRECT_MAX_TOKENS


def _pointer(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def quant_linear(x: Tensor, w: QuantWeight, bias: Tensor | None = None,
                 direct: bool | None = None) -> Tensor:
    """x_hat @ dequantize(w).T (+ bias) as the module docstring says; `direct` forces a path
    (None: use_direct)."""
    return linear_with_input_quant(lambda xq, part, b: _gemm(xq, part, b, direct), x, w, bias)


def _gemm(x: Tensor, w: QuantWeight, bias: Tensor | None, direct: bool | None) -> Tensor:
    columns, rows = w.in_features, w.out_features
    x2 = x.reshape(-1, columns)  # [T, I], a view when x is float32
    if x2.dtype != torch.float32 or x2.stride(-1) != 1:
        x2 = x2.float().contiguous()
    assert x.device.type == "cpu"
    if w.native is None:  # once per weight: 32 calls a decode step, ~15 us of Python each
        w.native = _weight_args(w)
    b = None if bias is None else bias.float().contiguous()
    tokens = x2.shape[0]
    y = torch.empty(tokens, rows, dtype=torch.float32)  # [T, O]
    failed = _kernel()(x2.data_ptr(), x2.stride(0), y.data_ptr(), rows, _pointer(b), tokens,
                       *w.native[0], use_direct(tokens) if direct is None else direct)
    if failed == 2:
        raise MemoryError("the CPU quantized GEMM could not allocate its buffers")
    assert not failed, f"quant_gemm_f32 refused kind {w.kind!r}, group size {w.group_size}"
    y = y if x.dtype == torch.float32 else y.to(x.dtype)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], rows)


def _weight_args(w: QuantWeight) -> tuple[tuple, tuple]:
    """quant_gemm_f32's arguments from `rows` to `row_slice`, and the tensors they point into
    (held, so the pointers stay valid)."""
    assert w.qweight.stride(1) == 1 and w.qweight.device.type == "cpu"
    scales, zeros, g_idx, row_slice = (
        t if t is None or t.is_contiguous() else t.contiguous()
        for t in (w.scales, w.zeros, w.g_idx, w.row_slice))
    args = (w.out_features, w.in_features, KIND_CODES[w.kind], w.qweight.data_ptr(),
            w.qweight.stride(0), scales.data_ptr(), _pointer(zeros), scales.shape[1],
            w.group_size, _pointer(g_idx), _pointer(row_slice))
    return args, (w.qweight, scales, zeros, g_idx, row_slice)


def lanes(flags: tuple[str, ...] = ()) -> int:
    """Floats per vector of the kernel as built (with `flags`): 16 AVX-512, 8 AVX2, 1 scalar."""
    return native.function("quant_gemm", "quant_gemm_lanes", "", "i", flags)()


def random_weight(kind: str, rows: int, columns: int, group_size: int, zeros: bool,
                  act_order: bool, g: torch.Generator) -> QuantWeight:
    """A QuantWeight of random values over the kind's whole range (fp8: every code but NaN's),
    scales of mixed magnitude; act order: two slices (the rows' halves), each its own
    permutation of the group map."""
    groups = -(-columns // group_size)
    if kind == "int4":
        q = pack_int4(torch.randint(-8, 8, (rows, columns), generator=g))
    elif kind == "int8":
        q = torch.randint(-128, 128, (rows, columns), generator=g, dtype=torch.int8)
    else:
        q = torch.randint(0, 256, (rows, columns), generator=g, dtype=torch.uint8)
        q[(q & 0x7F) == 0x7F] -= 1  # S.1111.111 is NaN: the largest finite code instead
    low, high = (-8, 8) if kind == "int4" else (-128, 128)
    w = QuantWeight(
        kind, q, torch.rand(rows, groups, generator=g) * torch.rand(rows, 1, generator=g) + 1e-3,
        torch.randint(low, high, (rows, groups), generator=g, dtype=torch.int8) if zeros else None,
        group_size, columns)
    if act_order:
        plain = torch.arange(columns) // group_size
        w.g_idx = torch.stack([plain[torch.randperm(columns, generator=g)]
                               for _ in range(2)]).to(torch.int32)
        w.row_slice = (torch.arange(rows) >= rows // 2).to(torch.int32)
    w.check()
    return w


def problem(got: Tensor, x: Tensor, w: QuantWeight, bias: Tensor | None = None) -> str | None:
    """What is wrong with `got` as quant_linear(x, w, bias) (None: nothing): each element
    within TOLERANCE of the float64 oracle, relative to the sum of its terms' magnitudes."""
    want = oracle_linear(x, w, bias)
    scale = x.double().abs() @ dequantize(w, torch.float64).abs().T  # [T, O]
    if bias is not None:
        scale = scale + bias.double().abs()
    error = ((got.double() - want).abs() / scale.clamp_min(1e-30)).max().item()
    return None if error <= TOLERANCE else f"relative error {error:.2e} > {TOLERANCE:.0e}"


def self_check() -> str | None:
    """Why quant_linear must not serve here (None: it may): built, then compared with the
    float64 oracle on small random weights of every kind, with and without zero points,
    channel-wise and in groups with a ragged last one, in act order, for 1, 3 and 17 tokens
    (both paths), with a bias."""
    g = torch.Generator().manual_seed(0)
    try:
        for kind in KINDS:
            for group_size, zeros, act_order in ((75, False, False), (16, True, False),
                                                 (16, False, True), (8, True, True)):
                w = random_weight(kind, 21, 75, group_size, zeros, act_order, g)
                bias = torch.randn(21, generator=g)
                for tokens in (1, 3, 17):
                    x = torch.randn(tokens, 75, generator=g)
                    found = problem(quant_linear(x, w, bias), x, w, bias)
                    if found is not None:
                        return (f"{kind}, groups of {group_size}, zeros {zeros}, act order "
                                f"{act_order}, {tokens} tokens: {found}")
    except Exception as exc:  # no compiler, a failed build or load
        return native.exception_problem(exc)
    return None
