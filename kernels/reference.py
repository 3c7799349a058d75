"""Plain-PyTorch LoRA kernels: the meaning of each Triton kernel, and the CPU production path.

Per-slot form: for each slot that has tokens, gather its tokens (index_select), multiply by
the rank-r slice of its weights (a rank-8 adapter in a rank-64 pool does rank-8 work), and
scatter back. Math runs in float32 whatever the input dtype (bf16 matmuls on CPU are ~100x
slower than fp32, and the kernels accumulate in fp32 too).

`oracle_shrink` / `oracle_apply` are the float64 per-token loops the tests compare against.
"""

from __future__ import annotations

from itertools import pairwise

import torch
from torch import Tensor

from kernels.meta import LoRAMeta


def lora_shrink(x: Tensor, lora_a: Tensor, ranks: Tensor, meta: LoRAMeta, y: Tensor) -> None:
    """y[i, t, :r] = x[t] @ lora_a[i, slot(t), :r].T   (r = ranks[i, slot(t)]; y is written only there)

    x: [T, H] (fp32/fp16/bf16)   lora_a: [n, S, R, H] (x.dtype)   ranks: [n, S] int32
    y: [n, T, R] float32, zero where not written
    """
    ranks_cpu = ranks.tolist()                                    # [n][S]
    for slot, start, count in meta.segments:
        ids = meta.sorted_token_ids[start:start + count].long()  # [c]
        xs = x.index_select(0, ids).float()                       # [c, H]
        for i, slice_ranks in enumerate(ranks_cpu):
            r = slice_ranks[slot]
            if r:
                y[i, ids, :r] = xs @ lora_a[i, slot, :r].float().T  # [c, r]


def lora_expand(out: Tensor, y: Tensor, lora_b: Tensor, ranks: Tensor, scales: Tensor,
                slice_offsets: tuple[int, ...], meta: LoRAMeta) -> None:
    """out[t, o[i]:o[i+1]] += scales[i, slot(t)] * y[i, t, :r] @ lora_b[slot(t), o[i]:o[i+1], :r].T

    out: [T, O] (x.dtype)   y: [n, T, R] float32   lora_b: [S, O, R] (x.dtype)
    ranks: [n, S] int32   scales: [n, S] float32   slice_offsets: n+1 ints, 0 .. O
    """
    ranks_cpu, scales_cpu = ranks.tolist(), scales.tolist()       # [n][S]
    for slot, start, count in meta.segments:
        ids = meta.sorted_token_ids[start:start + count].long()  # [c]
        for i, (lo, hi) in enumerate(pairwise(slice_offsets)):
            r = ranks_cpu[i][slot]
            if r:
                ys = y[i].index_select(0, ids)[:, :r]             # [c, r] fp32
                delta = scales_cpu[i][slot] * (ys @ lora_b[slot, lo:hi, :r].float().T)  # [c, hi-lo]
                out[:, lo:hi].index_add_(0, ids, delta.to(out.dtype))


def apply_lora(out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, ranks: Tensor,
               scales: Tensor, slice_offsets: tuple[int, ...], meta: LoRAMeta) -> None:
    """lora_shrink then lora_expand, fused per slot: no [n, T, R] intermediate is allocated.

    out: [T, O]   x: [T, H]   lora_a: [n, S, R, H]   lora_b: [S, O, R]   ranks, scales: [n, S]
    """
    ranks_cpu, scales_cpu = ranks.tolist(), scales.tolist()
    for slot, start, count in meta.segments:
        ids = meta.sorted_token_ids[start:start + count].long()  # [c]
        xs = x.index_select(0, ids).float()                       # [c, H]
        for i, (lo, hi) in enumerate(pairwise(slice_offsets)):
            r = ranks_cpu[i][slot]
            if r:
                ys = xs @ lora_a[i, slot, :r].float().T           # [c, r]
                delta = scales_cpu[i][slot] * (ys @ lora_b[slot, lo:hi, :r].float().T)
                out[:, lo:hi].index_add_(0, ids, delta.to(out.dtype))


def oracle_shrink(x: Tensor, lora_a: Tensor, ranks: Tensor, token_slots: Tensor) -> Tensor:
    """float64 per-token loop of lora_shrink, on the CPU. Returns y: [n, T, R] float64."""
    n, _, R, _ = lora_a.shape
    x, lora_a, ranks_cpu = x.cpu().double(), lora_a.cpu(), ranks.tolist()
    y = torch.zeros(n, x.shape[0], R, dtype=torch.float64)
    for t, slot in enumerate(token_slots.tolist()):
        for i in range(n):
            r = ranks_cpu[i][slot] if slot >= 0 else 0
            if r:
                y[i, t, :r] = lora_a[i, slot, :r].double() @ x[t]
    return y


def oracle_expand(out: Tensor, y: Tensor, lora_b: Tensor, ranks: Tensor, scales: Tensor,
                  slice_offsets: tuple[int, ...], token_slots: Tensor) -> Tensor:
    """float64 per-token loop of lora_expand, on the CPU. Returns the expected out: [T, O] float64."""
    expected = out.to("cpu", torch.float64, copy=True)            # [T, O]
    y, lora_b, ranks_cpu, scales_cpu = y.cpu().double(), lora_b.cpu(), ranks.tolist(), scales.tolist()
    for t, slot in enumerate(token_slots.tolist()):
        for i, (lo, hi) in enumerate(pairwise(slice_offsets)):
            r = ranks_cpu[i][slot] if slot >= 0 else 0
            if r:
                b = lora_b[slot, lo:hi, :r].double()              # [hi-lo, r]
                expected[t, lo:hi] += scales_cpu[i][slot] * (b @ y[i, t, :r])
    return expected


def oracle_apply(out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, ranks: Tensor,
                 scales: Tensor, slice_offsets: tuple[int, ...], token_slots: Tensor) -> Tensor:
    """float64 shrink then expand, per token. Returns the expected out: [T, O] float64."""
    y = oracle_shrink(x, lora_a, ranks, token_slots)
    return oracle_expand(out, y, lora_b, ranks, scales, slice_offsets, token_slots)
