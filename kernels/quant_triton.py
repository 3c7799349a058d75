"""The quantized-weight GEMM in Triton: W4A16 / W8A16 / FP8-weight, dequantizing in registers.

Meaning (kernels/quant.py's layout; `oracle_linear` is this line in float64):
    y[t, o] = sum_k x[t, k] * (q[o, k] - z[o, g(o, k)]) * s[o, g(o, k)]  (+ bias[o])
    g(o, k) = k // group_size, or g_idx[row_slice[o], k] with act order
W8A8 / FP8 schemes (a QuantWeight with `act`) first quantize x as the checkpoint declares, in
torch (kernels/act_quant.py: x_hat, per static slice where slices' scales differ); the kernel
then runs on x_hat, so the GPU computes what the CPU's dequant_linear does.

Each program owns one BLOCK_M x BLOCK_N tile of y and walks I in BLOCK_K steps: it loads the
tile's quantized weights ([BLOCK_K, BLOCK_N] codes: int4 nibbles, int8, or e4m3 bits), the
scale (and zero) of each element's group, forms W = (q - z) * s in fp32, rounds it to x.dtype
(the weight `dequantize(w, x.dtype)` gives, so the product is dequant_linear's) and adds
x_tile @ W_tile into an fp32 accumulator; y gets acc (+ bias) in x.dtype. Every weight byte is
read once per M tile; nothing dequantized goes back to memory.

Decoding. int4: byte k // 2 of the row, nibble k % 2 (low first), minus 8; the high nibble
past an odd I is padding, masked like every column >= I. fp8: the byte bitcast to
float8e4nv and widened, which needs the e4m3 conversion of sm_89+ (Ada, Hopper;
FP8_MIN_CAPABILITY): `triton_supports` says no for fp8 on an A100, where the engine
dequantizes and runs a plain GEMM instead. Groups are gathered per element ([BLOCK_K,
BLOCK_N] scale loads, L1 hits), so any group_size works: channel (one group), 32, 128, a
partial last group, and act order, where each output row reads its slice's g_idx row.

Grid: one axis of cdiv(T, BLOCK_M) * cdiv(O, BLOCK_N) programs, walked GROUP_M M-tiles at a
time for each N block (Triton's grouped ordering): consecutive programs share a weight tile, and
a prefill's x tiles stay in L2 while its weights stream by. T is never specialized
(QUANT_RUNTIME_ARGS), nor are the group count and size or whether there is a bias: one binary per
dtype, scheme and tile class serves every step, group layout and projection.

Configs (`quant_config`): steps of up to DECODE_MAX_TOKENS tokens (kernels/meta.py's decode
class) take 16 x 16 tiles, 128 deep, on 4 warps: decode is a memory-bound GEMV, so the grid
should have many programs (256 for a 4096-wide projection). Larger steps take 64 x 128 tiles,
32 deep, on 8 warps. Registers bound the tiles: the dequantization is per element (codes, group
gathers and their offsets), so twice these depths reach 234-255 registers (int4 with zero
points; with 64-bit weight offsets they spilled, hence int32 ones, which quant_matmul bounds);
these stay at or under 151 on sm_80 and sm_90 (kernels/aot_compile.py reads it; the compile
test fails on any spill). Reasoned and compiled, not yet timed on a GPU. Under
TRITON_INTERPRET=1 (one program at a time) every block is as large as the problem and the dot
operands are cast to fp32 (the interpreter's bf16 dot returns garbage); the interpreter also
decodes the e4m3 NaN codes 0x7F / 0xFF as +-480 (a checkpoint never holds them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from loragw.kernels.act_quant import linear_with_input_quant
from loragw.kernels.meta import DECODE_MAX_TOKENS
from loragw.kernels.quant import FP8_MIN_CAPABILITY, QuantWeight

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read once, as @triton.jit does
GROUP_M = 8   # M tiles walked per N block (grouped program order)
# The token count changes every step; group count and size change with the checkpoint, the
# bias with the projection: never specialized (== 1, 16-divisible), so one binary serves every
# step, group layout, and projection with or without a bias.
QUANT_RUNTIME_ARGS = ("T", "G", "group_size", "has_bias")


@triton.jit(do_not_specialize=QUANT_RUNTIME_ARGS)
def _quant_matmul_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, row_slice_ptr,
                         bias_ptr, y_ptr, T, out_features, in_features, G, group_size,
                         stride_xt, stride_xi, stride_qo, has_bias, KIND: tl.constexpr,
                         HAS_ZEROS: tl.constexpr,
                         ACT_ORDER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, CAST_FP32: tl.constexpr,
                         PRECISION: tl.constexpr):
    """y[t, o] = x[t] @ ((q[o] - z[o, g(o, :)]) * s[o, g(o, :)]) (+ bias[o]) for one tile of y.

    x: [T, I] fp32/fp16/bf16   qweight: [O, I] int8 | uint8 [O, ceil(I/2)] (int4) | uint8 [O, I]
    (fp8 bits), rows stride_qo apart   scales: [O, G] fp32   zeros: [O, G] int8 (HAS_ZEROS)
    g_idx: [n, I] int32, row_slice: [O] int32 (ACT_ORDER)   bias: [O] x.dtype (has_bias)
    y: [T, O] x.dtype, contiguous   KIND: "int4" | "int8" | "fp8"
    """
    pid = tl.program_id(0)  # -> (pid_m, pid_n): GROUP_M M tiles down, then the next N block
    num_m = tl.cdiv(T, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(out_features, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_here
    pid_n = (pid % per_group) // rows_here

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < T
    n_mask = offs_n < out_features
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xt                           # [BM]
    w_rows = offs_n * stride_qo                # [BN] int32: quant_matmul bounds the weight sizes
    group_rows = offs_n * G                                                    # [BN]: scales, zeros
    if ACT_ORDER:
        order = tl.load(row_slice_ptr + offs_n, mask=n_mask, other=0) * in_features  # [BN]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_features
        w_mask = k_mask[:, None] & n_mask[None, :]
        xt = tl.load(x_rows[:, None] + offs_k[None, :] * stride_xi,
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)       # [BM, BK]
        if KIND == "int4":  # byte k // 2, low nibble first; every byte is loaded for both
            byte = tl.load(qweight_ptr + w_rows[None, :] + (offs_k // 2)[:, None], mask=w_mask,
                           other=0)
            q = ((byte.to(tl.int32) >> ((offs_k % 2) * 4)[:, None]) & 0xF) - 8  # [BK, BN]
        elif KIND == "int8":
            q = tl.load(qweight_ptr + w_rows[None, :] + offs_k[:, None], mask=w_mask, other=0)
        else:
            bits = tl.load(qweight_ptr + w_rows[None, :] + offs_k[:, None], mask=w_mask, other=0)
            q = bits.to(tl.float8e4nv, bitcast=True)  # e4m3: sm_89+ (or the interpreter)
        q = q.to(tl.float32)                                                   # [BK, BN]
        if ACT_ORDER:
            g = tl.load(g_idx_ptr + order[None, :] + offs_k[:, None], mask=w_mask, other=0)  # [BK, BN]
        else:
            g = (offs_k // group_size)[:, None]                                # [BK, 1]
        at = group_rows[None, :] + g                                           # [BK, BN]
        if HAS_ZEROS:
            q -= tl.load(zeros_ptr + at, mask=w_mask, other=0).to(tl.float32)
        w = (q * tl.load(scales_ptr + at, mask=w_mask, other=0.0)).to(xt.dtype)  # [BK, BN]
        if CAST_FP32:
            acc += tl.dot(xt.to(tl.float32), w.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(xt, w, input_precision=PRECISION)

    if has_bias:  # a runtime flag: one branch per program, and half the binaries
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * out_features + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True, slots=True)
class QuantConfig:
    block_m: int   # tokens per program (>= 16: tl.dot's minimum)
    block_n: int   # output features per program (>= 16)
    block_k: int   # input features per loop step (>= 16)
    num_warps: int = 4


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def quant_config(tokens: int, out_features: int, in_features: int,
                 interpret: bool = INTERPRET) -> QuantConfig:
    """Decode-sized steps (<= DECODE_MAX_TOKENS tokens): 16 x 16 tiles, 128 deep, 4 warps;
    larger ones: 64 x 128 tiles, 32 deep, 8 warps (see the module docstring). The interpreter runs one
    program at a time, so there every block is as large as the problem."""
    if interpret:
        return QuantConfig(block_m=_pow2(tokens, 16, 64), block_n=_pow2(out_features, 16, 256),
                           block_k=_pow2(in_features, 16, 512))
    if tokens <= DECODE_MAX_TOKENS:
        return QuantConfig(block_m=16, block_n=16, block_k=128)
    return QuantConfig(block_m=64, block_n=128, block_k=32, num_warps=8)


def quant_grid(tokens: int, out_features: int, cfg: QuantConfig) -> tuple[int]:
    return (triton.cdiv(tokens, cfg.block_m) * triton.cdiv(out_features, cfg.block_n),)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 models get fp32 products


def triton_supports(kind: str, device: torch.device) -> bool:
    """Whether quant_matmul runs `kind` on `device` (else: kernels.quant.dequant_linear)."""
    if kind != "fp8" or device.type != "cuda":
        return True
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor >= FP8_MIN_CAPABILITY


def quant_matmul(x: Tensor, w: QuantWeight, bias: Tensor | None = None,
                 config: QuantConfig | None = None) -> Tensor:
    """y = x_hat @ dequantize(w).T (+ bias), accumulated in fp32; x_hat: x quantized as w.act
    declares (W8A8 / FP8 schemes; kernels/act_quant.py, in torch before the kernel), else x.

    x: [T, I] fp32/fp16/bf16 (any strides)   w: QuantWeight [O, I] on x's device
    bias: [O] x.dtype | None   ->  y: [T, O] x.dtype, contiguous
    """
    return linear_with_input_quant(
        lambda xq, part, b: _quant_matmul(xq, part, b, config), x, w, bias)


def _quant_matmul(x: Tensor, w: QuantWeight, bias: Tensor | None,
                  config: QuantConfig | None) -> Tensor:
    T, columns = x.shape
    rows = w.out_features
    assert columns == w.in_features, (
        f"x has {columns} features, the {w.kind} weight takes {w.in_features}")
    assert bias is None or (bias.shape == (rows,) and bias.dtype == x.dtype), "bias: [O], x.dtype"
    parts = [t for t in (w.scales, w.zeros, w.g_idx, w.row_slice) if t is not None]
    assert w.qweight.stride(1) == 1 and all(t.is_contiguous() for t in parts), (
        "qweight's rows and the scales, zeros, g_idx and row_slice must be contiguous")
    assert max(rows * w.qweight.stride(0), *(t.numel() for t in parts)) < 2**31, (
        "the kernel's weight offsets are int32: split a projection of 2^31 bytes or more")
    if not triton_supports(w.kind, x.device):
        major, minor = torch.cuda.get_device_capability(x.device)
        raise RuntimeError(f"fp8 weights need sm_{FP8_MIN_CAPABILITY}+ for the Triton GEMM, this "
                           f"GPU is sm_{major}{minor}: use loragw.kernels.quant.dequant_linear "
                           "(triton_supports says which)")
    y = torch.empty(T, rows, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    cfg = config or quant_config(T, rows, columns)
    absent = w.scales  # pointer for an absent operand: never read (its HAS_/ACT_ flag is off)
    _quant_matmul_kernel[quant_grid(T, rows, cfg)](
        x, w.qweight, w.scales, absent if w.zeros is None else w.zeros,
        absent if w.g_idx is None else w.g_idx, absent if w.g_idx is None else w.row_slice,
        y if bias is None else bias, y, T, rows, columns, w.scales.shape[1], w.group_size,
        x.stride(0), x.stride(1), w.qweight.stride(0), int(bias is not None),
        KIND=w.kind, HAS_ZEROS=w.zeros is not None, ACT_ORDER=w.g_idx is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=GROUP_M,
        CAST_FP32=INTERPRET, PRECISION=_precision(x.dtype), num_warps=cfg.num_warps)
    return y
