"""A quantized projection's input activations, quantized as the checkpoint declares
(compressed-tensors' `input_activations`; Hugging Face fp8's dynamic `activation_scheme`), in
exactly compressed-tensors' arithmetic (0.19: lifecycle/forward.py `forward_quantize` ->
utils/helpers.py `compute_dynamic_scales_and_zp`, `calculate_qparams` -> forward_helpers.py
`_quantize_dequantize`), every step in x's own dtype:

    q_min, q_max  int8: -128, 127     fp8 (e4m3): -448, 448        R = q_max - q_min (in x.dtype:
                                                                    bfloat16 rounds 255 to 256)
    dynamic  over each token's row, or each group of `group_size` columns of it:
        lo = min(min(x), 0)   hi = max(max(x), 0)
        symmetric   s = max(|lo|, |hi|) / (R / 2)                   z = 0
        asymmetric  s = (hi - lo) / R       z = Z(clamp(q_min - lo / s, q_min, q_max))
        s = finfo(x.dtype).eps where s == 0                        (after z: z saw the 0)
    static   s, z = the checkpoint's input_scale, input_zero_point (one per tensor), in x.dtype

    x_hat = (Q(clamp(x / s + z, q_min, q_max)) - z) * s
    Q, Z: int8: round half to even (Z: to int8); fp8: a cast to float8_e4m3fn and back

So int8's symmetric scale is max|x| / 127.5, not / 127: +max lands on 127, -max on -128.
y = x_hat @ W.T: the weight's GEMM is unchanged (`linear_with_input_quant` wraps any of them);
a LoRA delta reads the unquantized x, as PEFT's does around the quantized base layer.

Merged projections (q|k|v, gate|up): dynamic scales depend on x alone, so one x_hat serves
every slice. Static scales are each original module's own (compressed-tensors applies each
module's input_scale to the same x; vLLM takes their max, which differs from the checkpoint's
forward): equal scales collapse to one, different ones quantize x once per slice, each slice's
GEMM on its own x_hat (`rows`). Under tensor parallelism a row-parallel rank holds part of
each token's row: `spans_ranks` says its dynamic amax must be reduced over the ranks first
(the caller's `reduce_max`, engine/layers/weights.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

import torch
from torch import Tensor

ACT_KINDS = ("int8", "fp8")


@dataclass(frozen=True, slots=True, eq=False)
class ActQuant:
    """How a projection's input is quantized before its GEMM (see the module docstring)."""

    kind: str  # "int8" | "fp8"
    dynamic: bool  # scales from each token's own values; else the checkpoint's static ones
    symmetric: bool = True
    group_size: int | None = None  # dynamic: columns per scale along a token (None: the row)
    scales: Tensor | None = None  # static: float32 [n], slice i's input_scale
    zeros: Tensor | None = None  # static, when nonzero: float32 [n] (int8 or e4m3 values)
    rows: tuple[int, ...] = ()  # static, n > 1: output rows of each slice, in order
    spans_ranks: bool = False  # dynamic, row-parallel: this rank holds part of each scale group

    def check(self, out_features: int, in_features: int) -> None:
        """Raise ValueError unless the description is one quantize_activations runs."""
        problems = []
        if self.kind not in ACT_KINDS:
            problems.append(f"kind {self.kind!r} is not one of {ACT_KINDS}")
        if self.dynamic:
            if self.scales is not None or self.rows:
                problems.append("dynamic activations hold no static scales")
            if self.group_size is not None and self.group_size < in_features and (
                    in_features % self.group_size):
                problems.append(f"groups of {self.group_size} do not divide {in_features} "
                                "input columns")
        else:
            n = 0 if self.scales is None else self.scales.numel()
            if self.scales is None or self.scales.dim() != 1 or self.scales.dtype != torch.float32:
                problems.append("static activations need float32 scales [n]")
            elif not bool((torch.isfinite(self.scales) & (self.scales > 0)).all()):
                problems.append("an input_scale is not a positive finite number")
            if n > 1 and (len(self.rows) != n or sum(self.rows) != out_features):
                problems.append(f"{n} input scales for slices of {self.rows} rows, not "
                                f"{out_features}")
            if self.zeros is not None and self.zeros.shape != (n,):
                problems.append(f"{tuple(self.zeros.shape)} input zero points for {n} scales")
        if problems:
            raise ValueError(f"{self.kind} activations: {'; '.join(problems)}")

    def to(self, device: torch.device) -> ActQuant:
        move = (lambda t: None if t is None else t.to(device))
        return replace(self, scales=move(self.scales), zeros=move(self.zeros))

    def slices(self) -> list[tuple[int, int, ActQuant]]:
        """(first row, rows, this slice's one-scale ActQuant) per static slice; one entry
        (0, -1, self) when one x_hat serves every row."""
        if len(self.rows) <= 1:
            return [(0, -1, self)]
        out, start = [], 0
        for i, count in enumerate(self.rows):
            one = replace(self, scales=self.scales[i:i + 1], rows=(),
                          zeros=None if self.zeros is None else self.zeros[i:i + 1])
            out.append((start, count, one))
            start += count
        return out


def join_static(parts: list[tuple[ActQuant | None, int]]) -> ActQuant | None:
    """The ActQuant of a merged projection from its slices' (ActQuant, output rows), in order:
    dynamic ones are all alike; static ones keep a scale per slice unless all are equal."""
    acts = [act for act, _ in parts]
    if all(act is None for act in acts):
        return None
    first = acts[0]
    if any(act is None or act.kind != first.kind or act.dynamic != first.dynamic
           or act.symmetric != first.symmetric or act.group_size != first.group_size
           for act in acts):
        raise ValueError("the slices of one merged projection quantize their inputs "
                         "differently")
    if first.dynamic:
        return first
    scales = torch.cat([act.scales for act in acts])
    zeros = None
    if any(act.zeros is not None for act in acts):
        zeros = torch.cat([act.zeros if act.zeros is not None else torch.zeros_like(act.scales)
                           for act in acts])
    if bool((scales == scales[0]).all()) and (zeros is None or bool((zeros == zeros[0]).all())):
        return replace(first, scales=scales[:1], zeros=None if zeros is None else zeros[:1],
                       rows=())
    return replace(first, scales=scales, zeros=zeros, rows=tuple(rows for _, rows in parts))


@cache
def _range(kind: str, device: torch.device) -> tuple[Tensor, Tensor]:
    """q_min, q_max as compressed-tensors makes them: float32 0-dim tensors on x's device (they
    promote nothing: x's dtype wins; and a 0-dim operand on the device divides as theirs does).
    Made on the first call: the warm-up before a CUDA graph's capture."""
    if kind == "int8":
        return torch.tensor(-128.0, device=device), torch.tensor(127.0, device=device)
    top = torch.finfo(torch.float8_e4m3fn).max
    return torch.tensor(-top, device=device), torch.tensor(top, device=device)


def _round(v: Tensor, kind: str) -> Tensor:
    """Q: onto the kind's grid, back in v's dtype."""
    if kind == "int8":
        return torch.round(v)
    return v.to(torch.float8_e4m3fn).to(v.dtype)


def _dynamic_qparams(x: Tensor, act: ActQuant, q_min: Tensor, q_max: Tensor,
                     reduce_max: Callable[[Tensor], None] | None) -> tuple[Tensor, Tensor | None]:
    """s, z: [..., G, 1] over x: [..., G, group] (calculate_qparams, in x.dtype)."""
    lo = torch.amin(x, dim=-1, keepdim=True)
    hi = torch.amax(x, dim=-1, keepdim=True)
    if reduce_max is not None:  # this rank's columns are part of each group: max over ranks
        both = torch.stack((-lo, hi))
        reduce_max(both)
        lo, hi = -both[0], both[1]
    lo = torch.min(lo, torch.zeros_like(lo))
    hi = torch.max(hi, torch.zeros_like(hi))
    span = (q_max - q_min).to(x.dtype)
    zero = None
    if act.symmetric:
        scale = torch.max(torch.abs(lo), torch.abs(hi)) / (span / 2)
    else:
        scale = (hi - lo) / span
        zero = torch.clamp(q_min - (lo / scale), q_min, q_max)
        # Z: stored in the zero point's dtype and read back, as compressed-tensors does (an
        # all-zero row's 0/0 then converts as it does there)
        stored = torch.int8 if act.kind == "int8" else torch.float8_e4m3fn
        zero = (torch.round(zero) if act.kind == "int8" else zero).to(stored).to(x.dtype)
    # compressed-tensors' torch.where(s == 0, eps, s), without a tensor made from the host
    # (a CUDA graph captures this)
    return scale.masked_fill(scale == 0, torch.finfo(x.dtype).eps), zero


def quantize_activations(x: Tensor, act: ActQuant,
                         reduce_max: Callable[[Tensor], None] | None = None) -> Tensor:
    """x_hat: x [..., I] quantized and dequantized as `act` says, in x.dtype (the module
    docstring's formula). `act` holds one static scale at most (ActQuant.slices splits the
    others); reduce_max(t) maxes t over the tensor-parallel ranks in place (spans_ranks)."""
    assert len(act.rows) <= 1, "a per-slice static ActQuant: quantize each of act.slices()"
    if x.numel() == 0:
        return x
    q_min, q_max = _range(act.kind, x.device)
    if act.dynamic:
        columns = x.shape[-1]
        size = columns if act.group_size is None or act.group_size >= columns else act.group_size
        xg = x.unflatten(-1, (columns // size, size))  # [..., G, size]
        scale, zero = _dynamic_qparams(xg, act, q_min, q_max,
                                       reduce_max if act.spans_ranks else None)
    else:
        xg = x
        scale = act.scales.to(x.dtype)
        zero = None if act.zeros is None else act.zeros.to(x.dtype)
    scaled = xg / scale
    if zero is not None:  # a zero point of 0 only turns -0.0 into +0.0: skipped when absent
        scaled += zero
    q = _round(torch.clamp(scaled, q_min, q_max), act.kind)
    if zero is not None:
        q = q - zero
    return (q * scale).reshape(x.shape)


def linear_with_input_quant(gemm: Callable, x: Tensor, w, bias: Tensor | None = None) -> Tensor:
    """gemm(x_hat, w, bias) with x quantized as w.act declares (unchanged when it declares
    nothing); a per-slice static w.act runs gemm once per slice on that slice's rows.

    gemm: (x [T, I], QuantWeight [O, I], bias [O] | None) -> [T, O]   w: a QuantWeight
    """
    act = w.act
    if act is None:
        return gemm(x, w, bias)
    parts = act.slices()
    if len(parts) == 1:
        return gemm(quantize_activations(x, act), w, bias)
    ys = []
    for start, count, one in parts:
        part = w.rows(start, count)
        ys.append(gemm(quantize_activations(x, one), part,
                       None if bias is None else bias[start:start + count]))
    return torch.cat(ys, dim=-1)
