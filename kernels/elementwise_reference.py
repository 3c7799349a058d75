"""float64 oracles of a decoder layer's fused elementwise ops (kernels/cpu_fused.py in C,
kernels/fused_triton.py in Triton), and the start-up check both run before they serve."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from loragw.kernels.native import exception_problem


def oracle_add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor,
                        eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta, weight * s * rsqrt(mean(s^2) + eps)) in float64."""
    s = x.double() if delta is None else x.double() + delta.double()
    return s, weight.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)


def oracle_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin in float64. x: [T, n, D]   cos, sin: [T, 1, D]."""
    x, half = x.double(), x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos.double() + turned * sin.double()


def oracle_silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up in float64, gate_up = [gate | up]."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def fused_elementwise_problem(add_rms_norm: Callable, rotary: Callable,
                              silu_and_mul: Callable | None, device: torch.device,
                              dtype: torch.dtype) -> str | None:
    """Why these kernels must not serve (None: they may): run on small random rows of `dtype`
    on `device`, strided as the layers pass them (rows of a wider tensor, q and k views of one
    qkv row), and compared with the float64 oracles above (any exception is a problem too)."""
    try:
        g = torch.Generator().manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

        T, H, D, inter = 11, 40, 8, 24
        x, delta, weight = rand(T, 2 * H)[:, :H], rand(T, H), rand(H)
        errors = []
        for d in (delta, None):
            total, out = add_rms_norm(x, d, weight, 1e-6)
            want_sum, want = oracle_add_rms_norm(x, d, weight, 1e-6)
            errors += [_error(total, want_sum), _error(out, want)]
        qkv = rand(T, 7 * D)
        q, k = qkv[:, :4 * D].view(T, 4, D), qkv[:, 4 * D:6 * D].view(T, 2, D)
        angles = torch.randn(T, 1, D // 2, generator=g).repeat(1, 1, 2)
        cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
        for got, ref in zip(rotary(q, k, cos, sin), (q, k)):
            errors.append(_error(got, oracle_rotary(ref, cos, sin)))
        if silu_and_mul is not None:
            gate_up = rand(T, 3 * inter)[:, :2 * inter]
            errors.append(_error(silu_and_mul(gate_up), oracle_silu_and_mul(gate_up)))
        error = max(errors)
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        if not error <= tolerance:
            return f"max error {error:.2e} against float64 (tolerance {tolerance:.0e})"
    except Exception as exc:  # no compiler, a failed build, load or launch
        return exception_problem(exc)
    return None


def _error(got: Tensor, want: Tensor) -> float:
    """Largest difference relative to the reference's scale (1 at least)."""
    scale = max(1.0, want.abs().max().item())
    return (got.double().cpu() - want.cpu()).abs().max().item() / scale
