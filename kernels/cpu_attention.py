"""Paged decode attention on the CPU, reading K/V in place through the block tables
(kernels/csrc/paged_decode.c, built by kernels/native.py), where the torch path gathers every
row's blocks into a padded copy and then runs SDPA over it: that copy, written and read back,
was most of a decode step's attention time (engine/layers/attention.py). No compiler, a failed
build or a wrong result in `self_check` leaves the torch path serving (engine/forward/backends.py).
float32 or bfloat16: a bf16 engine's cache is read as held, widened in registers, the math in
float32, rounded to bf16 where torch's bf16 SDPA rounds (kernels/csrc/paged_decode.c).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from loragw.kernels import native

DTYPES = tuple(native.SUFFIXES)  # float32, bfloat16
# |out - float64's| a start-up check allows: float32's reassociated sums; bfloat16 adds out's
# rounding and each exp(s - max)'s, as SDPA's (2^-8 relative each: up to 2^-8 * (|out| + max |v|),
# ~0.03 for the check's N(0, 1) values, ~0.004 seen)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@functools.cache
def _library(dtype: torch.dtype):
    """The kernel's two functions for `dtype`, declared (raises when the library cannot be
    built)."""
    suffix = native.SUFFIXES[dtype]
    decode = native.function("paged_decode", f"paged_decode_{suffix}",
                             "plppppp" + "iiiiii" + "fif", "i")
    store = native.function("paged_decode", f"cache_store_{suffix}", "plplpppii")
    return decode, store


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> None:
    """k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t] (the step's new tokens), as
    index_copy_ on the flattened caches does, for a fraction of its per-call cost.

    k, v: [T, n_kv, D] float32 or bfloat16 (rows may be strided)   k_cache, v_cache: [N,
    block_size, n_kv, D] contiguous, k's dtype   slots: [T] int64, distinct, each < N *
    block_size"""
    T, n_kv, D = k.shape
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and k.dtype in DTYPES
    assert slots.dtype == torch.int64
    k, v = (t if t.stride(1) == D and t.stride(2) == 1 else t.contiguous() for t in (k, v))
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == (n_kv, D)
    slots = slots.contiguous()
    _library(k.dtype)[1](k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                         k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), T, n_kv * D)


def paged_attention_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                           context_lens: Tensor, scale: float, out: Tensor | None = None,
                           sliding_window: int | None = None,
                           softcap: float | None = None) -> Tensor:
    """out[b, h] = softmax(cap(scale * q[b, h] @ K[b, :, h // G].T)) @ V[b, :, h // G], K/V read
    through block_tables[b] up to context_lens[b] (its last `sliding_window` keys when given):
    kernels.paged_attention's contract, on the CPU in float32 or bfloat16 (q, caches and out
    all one of them; the math in float32).

    q: [B, n_heads, D] (last dim contiguous)   k_cache, v_cache: [N, block_size, n_kv, D]
    contiguous   block_tables: [B, W] int32   context_lens: [B] int32   out: [B, n_heads, D],
    written (allocated when None). Returns out."""
    B, n_heads, D = q.shape
    _, block_size, n_kv, _ = k_cache.shape
    assert q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in DTYPES, q.dtype
    assert out is None or out.dtype == q.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1
    assert q.stride(1) == D, "q's heads must be adjacent"
    tables, lens = block_tables.contiguous(), context_lens.contiguous()
    assert tables.dtype == lens.dtype == torch.int32
    result = out if out is not None and out.is_contiguous() else torch.empty(
        B, n_heads, D, dtype=q.dtype, device=q.device)
    failed = _library(q.dtype)[0](
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        lens.data_ptr(), result.data_ptr(), B, n_heads, n_kv, D, block_size, tables.shape[1],
        scale, sliding_window or 0, softcap or 0.0)
    if failed:
        raise MemoryError("the CPU attention kernel could not allocate its score buffer")
    if out is not None and result is not out:
        out.copy_(result)
    return out if out is not None else result


def self_check(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
               sliding_window: int | None = None, softcap: float | None = None) -> str | None:
    """Why the kernel must not serve these shapes here, or None when it may: built, then
    checked as kernels.reference.paged_decode_problem checks every paged decode kernel."""
    from loragw.kernels.reference import paged_decode_problem

    if dtype not in DTYPES:
        return f"{dtype} (the kernel takes float32 or bfloat16)"
    return paged_decode_problem(paged_attention_decode, torch.device("cpu"), dtype, num_heads,
                                num_kv_heads, head_dim, sliding_window, softcap,
                                tolerance=TOLERANCE[dtype])
