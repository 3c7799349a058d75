"""A decoder layer's elementwise ops on the CPU in C (kernels/csrc/fused_ops.c, built by
kernels/native.py): residual add + RMSNorm and rotary over q and k, each one call where the
torch layers run a chain of 4-12 small ops (at batch 32 on the bench Llama: add + norm 20 ->
9 us, rotary 45 -> 12 us, most of what remains the call itself). float32 or bfloat16 (bf16
rounded after every op torch's bf16 ops round, so rotary matches them bit for bit); the layers
keep their torch path for float16 and for Gemma's norm. Serves once `self_check` passed for the
engine's dtype (engine/forward/backends.py).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from loragw.kernels import native

DTYPES = tuple(native.SUFFIXES)  # float32, bfloat16


@functools.cache
def _library(dtype: torch.dtype):
    """The two functions for `dtype`, declared (raises when the library cannot be built)."""
    suffix = native.SUFFIXES[dtype]
    norm = native.function("fused_ops", f"add_rms_norm_{suffix}", "plplpfplplii")
    rotary = native.function("fused_ops", f"rotary_{suffix}", "plliplli" + "pppp" + "ii")
    return norm, rotary


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor,
                 eps: float) -> tuple[Tensor, Tensor]:
    """sum = x + delta (x itself when delta is None), out = weight * (sum * rsqrt(mean(sum^2,
    -1) + eps)): Llama's residual add and RMSNorm. x, delta: [T, H] float32 or bfloat16, last dim
    contiguous (rows may be strided)   weight: [H] contiguous, x's dtype. Returns (sum, out), out
    new."""
    T, H = x.shape
    assert weight.dtype == x.dtype and (delta is None or delta.dtype == x.dtype)
    out = torch.empty(T, H, dtype=x.dtype)
    total = x if delta is None else torch.empty(T, H, dtype=x.dtype)
    norm = _library(x.dtype)[0]
    norm(x.data_ptr(), x.stride(0), None if delta is None else delta.data_ptr(),
         H if delta is None else delta.stride(0), weight.data_ptr(), eps, total.data_ptr(),
         total.stride(0), out.data_ptr(), H, T, H)
    return total, out


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """q * cos + rotate_half(q) * sin, and the same for k (engine/layers/rotary.py
    apply_rotary). q: [T, n_heads, D], k: [T, n_kv, D] float32 or bfloat16, last dim contiguous
    cos, sin: [T, 1, D] contiguous, q's dtype. Returns new contiguous q, k."""
    T, n_q, D = q.shape
    n_k = k.shape[1]
    assert q.dtype == k.dtype == cos.dtype == sin.dtype
    q_out, k_out = torch.empty(T, n_q, D, dtype=q.dtype), torch.empty(T, n_k, D, dtype=q.dtype)
    _library(q.dtype)[1](q.data_ptr(), q.stride(0), q.stride(1), n_q, k.data_ptr(), k.stride(0),
                         k.stride(1), n_k, cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(),
                         k_out.data_ptr(), T, D)
    return q_out, k_out


def serves(x: Tensor) -> bool:
    """Whether these kernels take x (the layers' check, with the backend chosen): float32 or
    bfloat16, its last dim contiguous."""
    return x.dtype in DTYPES and x.stride(-1) == 1


# SiLU-and-mul stays torch's on the CPU: a C version (a vectorized exp polynomial) ran no faster
# than torch's silu and mul (29 vs 30 us at batch 32 on the bench Llama: both bound by the exp).
silu_and_mul = None


def self_check(dtype: torch.dtype = torch.float32) -> str | None:
    """Why these kernels must not serve `dtype` here (None: they may): built, then compared with
    the same math in float64 on small random rows of it, strided as the layers pass them."""
    from loragw.kernels.elementwise_reference import fused_elementwise_problem

    if dtype not in DTYPES:
        return f"{dtype} (the kernels take float32 or bfloat16)"
    return fused_elementwise_problem(add_rms_norm, rotary, None, torch.device("cpu"), dtype)
