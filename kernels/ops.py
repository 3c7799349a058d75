"""The LoRA calls the model makes, on a backend resolved once (`lora_kernels(name)`).

backend "torch": kernels/reference.py, per-slot index_select + matmul (the CPU production path).
backend "triton": kernels/lora_triton.py, imported on first use so that importing `kernels`
never needs a GPU driver (set TRITON_INTERPRET=1 before first use to run it on the CPU).

Buffers of one LoRA-wrapped projection with n output slices (qkv_proj: 3, gate_up_proj: 2):
    lora_a: [n, S, R, H]  x.dtype      lora_b: [S, O, R]  x.dtype (slice i owns rows o[i]:o[i+1])
    ranks:  [n, S] int32 (0 = none)    scales: [n, S] float32
    o = slice_offsets: (0, ..., O), n+1 python ints
slot(t) = meta.token_slots[t]; r = ranks[i, slot(t)]; the math runs in float32.

An embedding LoRA (PEFT's lora.Embedding) is the same with x one-hot over the vocabulary: its
shrink is a row gather, then the usual expand (`embedding_lora`). Its pool keeps A transposed,
one row per token id:
    lora_a: [S, V, R]   lora_b: [S, H, R]   ranks, scales: [1, S]
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from loragw.kernels import reference
from loragw.kernels.meta import LoRAMeta

BACKENDS = ("torch", "triton")


def _check(x: Tensor, lora_a: Tensor, ranks: Tensor, meta: LoRAMeta) -> None:
    n, S, _, H = lora_a.shape
    assert x.dim() == 2 and x.shape[1] == H, f"x must be [T, {H}], got {tuple(x.shape)}"
    assert x.shape[0] == meta.num_tokens, f"x has {x.shape[0]} tokens, meta has {meta.num_tokens}"
    assert S == meta.num_slots, f"lora_a has {S} slots, meta has {meta.num_slots}"
    assert meta.sorted_token_ids.device == x.device, (
        f"meta is on {meta.sorted_token_ids.device}, x on {x.device}: build it with "
        "make_lora_meta(token_slots.to(x.device), num_slots)")
    assert lora_a.dtype == x.dtype and lora_a.is_contiguous(), "lora_a must be contiguous, dtype of x"
    assert ranks.shape == (n, S) and ranks.dtype == torch.int32, f"ranks must be [{n}, {S}] int32"


@dataclass(frozen=True, slots=True)
class LoRAKernels:
    """One backend's LoRA calls, resolved once (`lora_kernels(name)`): what the layers call,
    with no lookup by name per call. `impl` is kernels/reference.py or kernels/lora_triton.py."""

    name: str
    impl: ModuleType

    def shrink(self, x: Tensor, lora_a: Tensor, ranks: Tensor, meta: LoRAMeta) -> Tensor:
        """y[i, t, :r] = x[t] @ lora_a[i, slot(t), :r].T   (r = ranks[i, slot(t)])

        x: [T, H]   lora_a: [n, S, R, H] (x.dtype)   ranks: [n, S] int32
        Returns y: [n, T, R] float32; rows of tokens with slot -1 and columns >= r are zero.
        """
        _check(x, lora_a, ranks, meta)
        n, _, R, _ = lora_a.shape
        y = torch.zeros(n, x.shape[0], R, dtype=torch.float32, device=x.device)  # [n, T, R]
        if x.shape[0]:
            self.impl.lora_shrink(x, lora_a, ranks, meta, y)
        return y

    def expand(self, out: Tensor, y: Tensor, lora_b: Tensor, ranks: Tensor, scales: Tensor,
               slice_offsets: tuple[int, ...], meta: LoRAMeta) -> None:
        """out[t, o[i]:o[i+1]] += scales[i, slot(t)] * y[i, t, :r] @ lora_b[slot(t), o[i]:o[i+1], :r].T

        out: [T, O] (x.dtype), in place; tokens with slot -1 untouched   y: [n, T, R] float32
        lora_b: [S, O, R] (out.dtype)   ranks: [n, S] int32   scales: [n, S] float32
        slice_offsets: n+1 python ints, 0 .. O
        """
        n, T, R = y.shape
        S, O_total, _ = lora_b.shape
        assert out.shape == (T, O_total) and out.dtype == lora_b.dtype, (
            f"out must be [{T}, {O_total}] {lora_b.dtype}, got {tuple(out.shape)} {out.dtype}")
        assert y.dtype == torch.float32 and y.is_contiguous(), "y must be contiguous float32"
        assert lora_b.shape == (S, O_total, R) and lora_b.is_contiguous(), f"lora_b must be [S, {O_total}, {R}] contiguous"
        assert len(slice_offsets) == n + 1 and slice_offsets[0] == 0 and slice_offsets[-1] == O_total, (
            f"slice_offsets must run 0 .. {O_total} over {n} slices, got {slice_offsets}")
        assert ranks.shape == (n, S) and scales.shape == (n, S) and scales.dtype == torch.float32
        assert S == meta.num_slots and T == meta.num_tokens
        if T:
            self.impl.lora_expand(out, y, lora_b, ranks, scales, tuple(slice_offsets), meta)

    def apply(self, out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, ranks: Tensor,
              scales: Tensor, slice_offsets: tuple[int, ...], meta: LoRAMeta) -> None:
        """out[t, o[i]:o[i+1]] += scales[i, s] * (x[t] @ lora_a[i, s, :r].T) @ lora_b[s, o[i]:o[i+1], :r].T
        with s = slot(t), r = ranks[i, s]; in place, tokens with slot -1 untouched.

        out: [T, O]   x: [T, H]   lora_a: [n, S, R, H]   lora_b: [S, O, R]   ranks, scales: [n, S]
        Callers skip the call when not meta.has_lora (a captured CUDA graph must not skip).
        """
        if self.impl is reference:  # one fused call: the CPU production path
            _check(x, lora_a, ranks, meta)
            assert out.shape == (x.shape[0], lora_b.shape[1]), f"out must be [T, {lora_b.shape[1]}]"
            reference.apply_lora(out, x, lora_a, lora_b, ranks, scales, tuple(slice_offsets), meta)
            return
        y = self.shrink(x, lora_a, ranks, meta)              # [n, T, R] fp32
        self.expand(out, y, lora_b, ranks, scales, slice_offsets, meta)

    def embedding(self, out: Tensor, ids: Tensor, lora_a: Tensor, lora_b: Tensor, ranks: Tensor,
                  scales: Tensor, meta: LoRAMeta) -> None:
        """out[t] += scales[0, s] * lora_a[s, ids[t], :r] @ lora_b[s, :, :r].T
        with s = slot(t), r = ranks[0, s]; in place, tokens with slot -1 untouched.

        out: [T, H] (lora_b.dtype)   ids: [T] int, < V   lora_a: [S, V, R] (PEFT's
        lora_embedding_A transposed)   lora_b: [S, H, R] (lora_embedding_B)   ranks, scales: [1, S]
        The gather runs in torch on any backend; the expand is this backend's.
        """
        S, V, R = lora_a.shape
        T = ids.shape[0]
        assert ids.shape == (T,) and T == meta.num_tokens, f"ids must be [{meta.num_tokens}]"
        assert lora_a.is_contiguous() and lora_a.dtype == lora_b.dtype and S == meta.num_slots
        rows = meta.token_slots.long().clamp(min=0) * V + ids.long()  # [T] (slot -1: never read)
        y = lora_a.view(S * V, R).index_select(0, rows).float().unsqueeze(0)  # [1, T, R] fp32
        self.expand(out, y, lora_b, ranks, scales, (0, out.shape[1]), meta)


@functools.cache
def lora_kernels(name: str) -> LoRAKernels:
    """The backend `name`'s kernels (Triton imported here, on first use)."""
    if name == "torch":
        return LoRAKernels(name, reference)
    if name == "triton":
        return LoRAKernels(name, importlib.import_module("loragw.kernels.lora_triton"))
    raise ValueError(f"LoRA backend must be one of {', '.join(BACKENDS)}; got {name!r}")


# The same calls by backend name, for callers that pick per call (tests, benchmarks).
def lora_shrink(x: Tensor, lora_a: Tensor, ranks: Tensor, meta: LoRAMeta,
                backend: str = "torch") -> Tensor:
    return lora_kernels(backend).shrink(x, lora_a, ranks, meta)


def lora_expand(out: Tensor, y: Tensor, lora_b: Tensor, ranks: Tensor, scales: Tensor,
                slice_offsets: tuple[int, ...], meta: LoRAMeta, backend: str = "torch") -> None:
    lora_kernels(backend).expand(out, y, lora_b, ranks, scales, slice_offsets, meta)


def apply_lora(out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, ranks: Tensor,
               scales: Tensor, slice_offsets: tuple[int, ...], meta: LoRAMeta,
               backend: str = "torch") -> None:
    lora_kernels(backend).apply(out, x, lora_a, lora_b, ranks, scales, slice_offsets, meta)


def embedding_lora(out: Tensor, ids: Tensor, lora_a: Tensor, lora_b: Tensor, ranks: Tensor,
                   scales: Tensor, meta: LoRAMeta, backend: str = "torch") -> None:
    lora_kernels(backend).embedding(out, ids, lora_a, lora_b, ranks, scales, meta)
