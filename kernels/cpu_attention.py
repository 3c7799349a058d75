"""Paged decode attention on the CPU, reading K/V in place through the block tables
(kernels/csrc/paged_decode.c, built by kernels/native.py), where the torch path gathers every
row's blocks into a padded copy and then runs SDPA over it: that copy, written and read back,
was most of a decode step's attention time (engine/layers/attention.py). No compiler, a failed
build or a wrong result in `self_check` leaves the torch path serving (engine/backends.py).
float32 only.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kernels import native


@functools.cache
def _library():
    """The kernel's two functions, declared (raises when the library cannot be built)."""
    decode = native.function("paged_decode", "paged_decode_f32", "plppppp" + "iiiiii" + "fif", "i")
    store = native.function("paged_decode", "cache_store_f32", "plplpppii")
    return decode, store


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> None:
    """k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t] (the step's new tokens), as
    index_copy_ on the flattened caches does, for a fraction of its per-call cost.

    k, v: [T, n_kv, D] float32 (rows may be strided)   k_cache, v_cache: [N, block_size, n_kv,
    D] contiguous   slots: [T] int64, distinct, each < N * block_size"""
    T, n_kv, D = k.shape
    assert k.dtype == v.dtype == k_cache.dtype == torch.float32 and slots.dtype == torch.int64
    k, v = (t if t.stride(1) == D and t.stride(2) == 1 else t.contiguous() for t in (k, v))
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == (n_kv, D)
    slots = slots.contiguous()
    _library()[1](k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                               k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), T,
                               n_kv * D)


def paged_attention_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                           context_lens: Tensor, scale: float, out: Tensor | None = None,
                           sliding_window: int | None = None,
                           softcap: float | None = None) -> Tensor:
    """out[b, h] = softmax(cap(scale * q[b, h] @ K[b, :, h // G].T)) @ V[b, :, h // G], K/V read
    through block_tables[b] up to context_lens[b] (its last `sliding_window` keys when given):
    kernels.paged_attention's contract, on the CPU in float32.

    q: [B, n_heads, D] (last dim contiguous)   k_cache, v_cache: [N, block_size, n_kv, D]
    contiguous   block_tables: [B, W] int32   context_lens: [B] int32   out: [B, n_heads, D],
    written (allocated when None). Returns out."""
    B, n_heads, D = q.shape
    _, block_size, n_kv, _ = k_cache.shape
    assert q.dtype == k_cache.dtype == v_cache.dtype == torch.float32, "float32 only"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1
    assert q.stride(1) == D, "q's heads must be adjacent"
    tables, lens = block_tables.contiguous(), context_lens.contiguous()
    assert tables.dtype == lens.dtype == torch.int32
    result = out if out is not None and out.is_contiguous() else torch.empty(
        B, n_heads, D, dtype=q.dtype, device=q.device)
    failed = _library()[0](
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
    """Why the kernel must not serve these shapes here, or None when it may: builds it, then
    compares one small random paged cache (ragged contexts across block boundaries, shuffled
    blocks) with the float64 reference, plainly and with the model's window and cap."""
    from kernels.reference import oracle_paged_attention

    if dtype != torch.float32:
        return f"{dtype} (the kernel is float32 only)"
    try:
        _library()
        g = torch.Generator().manual_seed(0)
        tables = torch.randperm(12, generator=g)[:9].view(3, 3).to(torch.int32)
        q = torch.randn(3, num_heads, head_dim, generator=g)
        k_cache, v_cache = (torch.randn(12, 16, num_kv_heads, head_dim, generator=g)
                            for _ in range(2))
        lens = torch.tensor([1, 17, 40], dtype=torch.int32)
        cases = [(None, None)]
        if sliding_window is not None or softcap is not None:
            cases.append((min(sliding_window, 24) if sliding_window else None, softcap))
        for window, cap in cases:
            got = paged_attention_decode(q, k_cache, v_cache, tables, lens, head_dim ** -0.5,
                                         sliding_window=window, softcap=cap)
            want = oracle_paged_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5,
                                          window, cap)
            error = (got.double() - want).abs().max().item()
            if not error <= 1e-5:
                return f"max error {error:.2e} against the float64 reference"
    except Exception as exc:  # no compiler, a failed build or load
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
    return None
