"""A layer's residual add + RMSNorm, rotary and SiLU-and-mul, one interface chosen once per
engine (Backends.elementwise, engine/forward/backends.py): torch's ops, or fused kernels that
compute the same (kernels/cpu_fused.py in C on a float32 or bfloat16 CPU engine,
kernels/fused_triton.py on CUDA), each checked against kernels/elementwise_reference.py at start-up for the engine's
dtype, so a step never asks per call whether a kernel takes its tensors.

    sum, out = add_rms_norm(x, delta, w, eps)   sum = x + delta (x when delta is None),
                                                out = w * (sum * rsqrt(mean(sum^2) + eps))
    q, k     = rotary(q, k, cos, sin)           q * cos + rotate_half(q) * sin, k alike
    out      = silu_and_mul(gate_up)            silu(gate) * up, gate_up = [gate | up]
Shapes: x, delta [T, H]; q [T, n_q, D], k [T, n_k, D], cos, sin [T, 1, D]; gate_up [T, 2I].
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm as Hugging Face computes it: float32 statistics, cast, then scaled."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Elementwise:
    """torch's ops."""

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        total = x if delta is None else x + delta
        return total, rms_norm(total, weight, eps)

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        return F.silu(gate) * up


class FusedElementwise(Elementwise):
    """A kernels module's add_rms_norm and rotary, one call each; its silu_and_mul where it
    has one that pays (`silu`), else torch's."""

    def __init__(self, kernels: ModuleType, silu: bool):
        self.kernels, self.silu = kernels, silu

    def add_rms_norm(self, x, delta, weight, eps):
        return self.kernels.add_rms_norm(x, delta, weight, eps)

    def rotary(self, q, k, cos, sin):
        return self.kernels.rotary(q, k, cos, sin)

    def silu_and_mul(self, gate_up):
        return self.kernels.silu_and_mul(gate_up) if self.silu else super().silu_and_mul(gate_up)


TORCH = Elementwise()  # outside a step (a layer called on its own), and Backends' "torch"
