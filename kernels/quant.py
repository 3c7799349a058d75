"""Quantized projection weights: the one layout every checkpoint format is converted to at load
(engine/quant/), its meaning, and the GEMMs that read it.

    W[o, k] = (q[o, k] - z[o, g(k)]) * s[o, g(k)]            (z = 0 when symmetric)

    kind   qweight                                     q[o, k]
    int4   uint8 [O, ceil(I/2)], two columns a byte:   (byte >> 4 * (k % 2) & 0xF) - 8  (-8..7)
           column 2j in the low nibble
    int8   int8 [O, I]                                 qweight[o, k]                 (-128..127)
    fp8    uint8 [O, I], the bits of float8_e4m3fn     qweight[o, k] viewed as e4m3, as float

    scales  float32 [O, G]      one per output row and group (channel: G = 1; FP8 per-tensor:
                                the one scale on every row; FP8 block [bo, bi]: each row gets its
                                block's scale, groups of bi columns)
    zeros   int8 [O, G] | None  in q's own range (int4: -8..7); None: symmetric
    group_size                  columns per group: g(k) = k // group_size, G = ceil(I / group_size)
    g_idx   int32 [n, I] | None act order (GPTQ desc_act, compressed-tensors actorder=group):
                                g(k) = g_idx[row_slice[o], k], one row per output slice of a
                                merged projection (q, k and v each keep their own order)
    row_slice int32 [O] | None  with g_idx: which g_idx row output row o uses
    act     ActQuant | None     W8A8 / FP8 schemes' input activations (kernels/act_quant.py):
                                every GEMM here quantizes x as the checkpoint's forward does
                                (x_hat = (Q(x / s + z) - z) * s, per token, group or tensor)
                                before multiplying; None: weight-only (W4A16, W8A16, ...)

Math (the dequantized weight, then the GEMM) runs in float32 whatever the activation dtype; in
float32 `dequantize` is bit-for-bit the weight compressed-tensors decompresses to
((q - z) * s, one rounding), so a dequantize-then-GEMM projection is the decompressed model's;
with `act`, x_hat is compressed-tensors' own fake quantization in x.dtype, so the projection is
the checkpoint's forward (transformers running compressed-tensors' quantized Linear).

    y = dequant_linear(x, w, bias)      # x: [T, I] -> y: [T, O], x.dtype: any device
    y = quant_linear(x, w, bias)        # kernels/cpu_quant.py: the CPU, in C
    y = quant_matmul(x, w, bias)        # kernels/quant_triton.py: CUDA (imported on first use)
    x_hat = quantize_activations(x, w.act)   # kernels/act_quant.py, for any other GEMM:
    y = linear_with_input_quant(gemm, x, w, bias)   # gemm(x_hat, w, bias), per static slice

On the CPU the engine's Backends.quant is "cpu" (kernels/cpu_quant.py: a C kernel reading this
layout as it is held, dequantizing in registers to the same float32 weights), once it passed
its start-up check; dequantize-then-GEMM, which writes the whole float32 weight and reads it
back on every call, is the fallback. torch's own weight-only kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`) were slower than even that at every batch (benchmarks/RESULTS.md,
"Quantized bases"; benchmarks/bench_quant.py's last table has all of them side by side).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from loragw.kernels.act_quant import ActQuant, linear_with_input_quant

KINDS = ("int4", "int8", "fp8")
BITS = {"int4": 4, "int8": 8, "fp8": 8}
# The Triton GEMM widens e4m3 with the conversion sm_89+ has (Ada, Hopper); older GPUs run fp8
# weights through dequant_linear (kernels/quant_triton.py `triton_supports`).
FP8_MIN_CAPABILITY = 89


@dataclass(slots=True)
class QuantWeight:
    """One projection's weight as it stays in memory (see the module docstring)."""

    kind: str
    qweight: Tensor
    scales: Tensor
    zeros: Tensor | None
    group_size: int
    in_features: int
    g_idx: Tensor | None = None
    row_slice: Tensor | None = None
    act: ActQuant | None = None  # None: activations stay as they come
    # the CPU kernel's arguments that depend on the weight alone, made on its first call
    # (kernels/cpu_quant.py); never copied by replace(), so a slice of rows makes its own
    native: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.qweight, self.scales, self.zeros, self.g_idx, self.row_slice)
                   if t is not None)

    def check(self) -> None:
        """Raise ValueError unless shapes, dtypes and index ranges are as the layout says (a
        converter's output, before it serves: the GPU kernel reads through g_idx and row_slice
        without bounds checks, so a checkpoint's out-of-range map must never reach it)."""
        if self.kind not in KINDS:
            raise ValueError(f"quantized weight kind {self.kind!r} is not one of {KINDS}")
        rows, columns = self.out_features, self.in_features
        packed = -(-columns // 2) if self.kind == "int4" else columns
        dtype = torch.int8 if self.kind == "int8" else torch.uint8
        groups = self.scales.shape[1] if self.scales.dim() == 2 else -1
        problems = []
        if self.qweight.shape != (rows, packed) or self.qweight.dtype != dtype:
            problems.append(f"qweight is {self.qweight.dtype} {tuple(self.qweight.shape)}, not "
                            f"{dtype} [{rows}, {packed}]")
        if self.scales.dtype != torch.float32 or self.scales.dim() != 2 or (
                self.scales.shape[0] != rows):
            problems.append(f"scales are {self.scales.dtype} {tuple(self.scales.shape)}, not "
                            f"float32 [{rows}, G]")
        if self.g_idx is None and groups != -(-columns // self.group_size):
            problems.append(f"{groups} scale groups for {columns} columns in groups of "
                            f"{self.group_size}")
        if self.g_idx is not None:
            slices = self.g_idx.shape[0]
            if (self.g_idx.dtype != torch.int32 or self.g_idx.dim() != 2
                    or self.g_idx.shape[1] != columns or self.row_slice is None
                    or self.row_slice.dtype != torch.int32 or self.row_slice.shape != (rows,)):
                problems.append("g_idx must be int32 [n, I] with row_slice int32 [O]")
            elif not (bool(((self.g_idx >= 0) & (self.g_idx < groups)).all())
                      and bool(((self.row_slice >= 0) & (self.row_slice < slices)).all())):
                problems.append(f"g_idx names groups outside 0..{groups - 1}")
        if self.zeros is not None:
            low, high = (-8, 7) if self.kind == "int4" else (-128, 127)
            if self.zeros.shape != (rows, groups) or self.zeros.dtype != torch.int8:
                problems.append(f"zero points are {self.zeros.dtype} "
                                f"{tuple(self.zeros.shape)}, not int8 [{rows}, {groups}]")
            elif not bool(((self.zeros >= low) & (self.zeros <= high)).all()):
                problems.append(f"zero points outside {low}..{high}")
        if problems:
            raise ValueError(f"{self.kind} weight: {'; '.join(problems)}")
        if self.act is not None:
            self.act.check(rows, columns)

    def rows(self, start: int, length: int) -> QuantWeight:
        """Output rows [start, start + length): a slice of a merged projection, a column-parallel
        rank's share (a per-slice static `act` keeps the one slice those rows are)."""
        cut = slice(start, start + length)
        act = self.act
        if act is not None and act.rows:
            act = next((one for first, count, one in act.slices()
                        if (first, count) == (start, length)), None)
            assert act is not None, f"rows {start}..{start + length} are not one input slice"
        return replace(self, qweight=self.qweight[cut], scales=self.scales[cut],
                       zeros=None if self.zeros is None else self.zeros[cut],
                       row_slice=None if self.row_slice is None else self.row_slice[cut],
                       act=act)


def unpack_int4(packed: Tensor, columns: int) -> Tensor:
    """uint8 [O, ceil(I/2)] -> int8 [O, I] in -8..7 (column 2j: the low nibble of byte j)."""
    low = (packed & 0xF).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).flatten(-2)[..., :columns]


def pack_int4(q: Tensor) -> Tensor:
    """int [O, I] in -8..7 -> uint8 [O, ceil(I/2)] (the inverse of unpack_int4)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.shape[-1] % 2:
        u = F.pad(u, (0, 1), value=8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def int_values(w: QuantWeight) -> Tensor:
    """q of the layout as a float32 [O, I] (exact: small integers, or e4m3 values)."""
    if w.kind == "int4":
        return unpack_int4(w.qweight, w.in_features).float()
    if w.kind == "fp8":
        return w.qweight.view(torch.float8_e4m3fn).float()
    return w.qweight.float()


def group_index(w: QuantWeight) -> Tensor:
    """g(o, k) as an int64 [O, I] (act order), or [1, I] shared by every row."""
    if w.g_idx is not None:
        return w.g_idx.long()[w.row_slice.long()]
    k = torch.arange(w.in_features, device=w.scales.device)
    return (k // w.group_size).unsqueeze(0)


def dequantize(w: QuantWeight, dtype: torch.dtype = torch.float32) -> Tensor:
    """W: [O, I] in `dtype`, computed in float32 (float64 when asked: the tests' oracle)."""
    math = torch.float64 if dtype == torch.float64 else torch.float32
    q = int_values(w).to(math)  # [O, I], a fresh tensor: the math below runs in place
    rows, columns, size = w.out_features, w.in_features, w.group_size
    if w.g_idx is None and columns % size == 0:  # whole groups: broadcast, no gather
        q = q.view(rows, columns // size, size)
        if w.zeros is not None:
            q.sub_(w.zeros.to(math).unsqueeze(-1))
        return q.mul_(w.scales.to(math).unsqueeze(-1)).view(rows, columns).to(dtype)
    groups = group_index(w).expand(rows, -1)
    if w.zeros is not None:
        q.sub_(torch.gather(w.zeros.to(math), 1, groups))
    return q.mul_(torch.gather(w.scales.to(math), 1, groups)).to(dtype)


def dequant_linear(x: Tensor, w: QuantWeight, bias: Tensor | None = None) -> Tensor:
    """y = x_hat @ W.T (+ bias): the dequantize-then-GEMM path (any device, any dtype); x_hat
    is x quantized as w.act declares, else x."""
    return linear_with_input_quant(_dequant_gemm, x, w, bias)


def _dequant_gemm(x: Tensor, w: QuantWeight, bias: Tensor | None) -> Tensor:
    return F.linear(x, dequantize(w, x.dtype), bias)


def oracle_linear(x: Tensor, w: QuantWeight, bias: Tensor | None = None) -> Tensor:
    """The float64 meaning the kernels are tested against (x_hat, defined in x.dtype, then a
    float64 product)."""
    return linear_with_input_quant(_oracle_gemm, x, w, bias)


def _oracle_gemm(x: Tensor, w: QuantWeight, bias: Tensor | None) -> Tensor:
    y = x.double() @ dequantize(w, torch.float64).T
    return y if bias is None else y + bias.double()
