"""A decoder layer's elementwise ops on the CPU in C (kernels/csrc/fused_ops.c, built by
kernels/native.py): residual add + RMSNorm and rotary over q and k, each one call where the
torch layers run a chain of 4-12 small ops (at batch 32 on the bench Llama: add + norm 20 ->
9 us, rotary 45 -> 12 us, most of what remains the call itself). float32 only; the layers keep
their torch path for other dtypes and for Gemma's norm. Serves once `self_check` passed
(engine/forward/backends.py).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from loragw.kernels import native


@functools.cache
def _library():
    """The two functions, declared (raises when the library cannot be built)."""
    norm = native.function("fused_ops", "add_rms_norm_f32", "plplpfplplii")
    rotary = native.function("fused_ops", "rotary_f32", "plliplli" + "pppp" + "ii")
    return norm, rotary


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor,
                 eps: float) -> tuple[Tensor, Tensor]:
    """sum = x + delta (x itself when delta is None), out = weight * (sum * rsqrt(mean(sum^2,
    -1) + eps)): Llama's residual add and RMSNorm. x, delta: [T, H] float32, last dim
    contiguous (rows may be strided)   weight: [H] contiguous. Returns (sum, out), out new."""
    T, H = x.shape
    out = torch.empty(T, H)
    total = x if delta is None else torch.empty(T, H)
    _library()[0](x.data_ptr(), x.stride(0), None if delta is None else delta.data_ptr(),
                  H if delta is None else delta.stride(0), weight.data_ptr(), eps,
                  total.data_ptr(), total.stride(0), out.data_ptr(), H, T, H)
    return total, out


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """q * cos + rotate_half(q) * sin, and the same for k (engine/layers/rotary.py
    apply_rotary). q: [T, n_heads, D], k: [T, n_kv, D] float32, last dim contiguous   cos, sin:
    [T, 1, D] contiguous. Returns new contiguous q, k."""
    T, n_q, D = q.shape
    n_k = k.shape[1]
    q_out, k_out = torch.empty(T, n_q, D), torch.empty(T, n_k, D)
    _library()[1](q.data_ptr(), q.stride(0), q.stride(1), n_q, k.data_ptr(), k.stride(0),
                  k.stride(1), n_k, cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(),
                  k_out.data_ptr(), T, D)
    return q_out, k_out


def serves(x: Tensor) -> bool:
    """Whether these kernels take x (the layers' check, with the backend chosen): float32, its
    last dim contiguous."""
    return x.dtype is torch.float32 and x.stride(-1) == 1


# SiLU-and-mul stays torch's on the CPU: a C version (a vectorized exp polynomial) ran no faster
# than torch's silu and mul (29 vs 30 us at batch 32 on the bench Llama: both bound by the exp).
silu_and_mul = None


def self_check() -> str | None:
    """Why these kernels must not serve here (None: they may): built, then compared with the
    same math in float64 on small random rows, strided as the layers pass them."""
    from loragw.kernels.elementwise_reference import fused_elementwise_problem

    return fused_elementwise_problem(add_rms_norm, rotary, None, torch.device("cpu"),
                                     torch.float32)
