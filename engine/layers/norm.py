"""RMSNorm, computed the way Hugging Face Llama and Gemma do (float32 statistics); Llama's in
C on a float32 CPU engine (kernels/cpu_fused.py, chosen in engine/backends.py)."""

import torch
from torch import nn

from engine.forward_context import elementwise_in_c
from engine.layers.parts import Loadable
from kernels import cpu_fused


class RMSNorm(nn.Module, Loadable):
    in_c = True  # Llama's formula is the C kernel's

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def _c(self, x: torch.Tensor) -> bool:
        return self.in_c and x.dim() == 2 and elementwise_in_c() and cpu_fused.serves(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._c(x):
            return cpu_fused.add_rms_norm(x, None, self.weight, self.eps)[1]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after a block and its norm: (x + delta, self(x + delta))."""
        if self._c(x) and cpu_fused.serves(delta):
            return cpu_fused.add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is an offset from 1 and the scaling happens in float32
    before the cast back, (x * (1 + w)).to(dtype), where Llama casts first, x.to(dtype) * w."""

    in_c = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(dtype)
