"""RMSNorm, computed the way Hugging Face Llama and Gemma do (float32 statistics); Llama's as
one fused kernel where the step's backend has one (kernels/cpu_fused.py in C on a float32 CPU
engine, kernels/fused_triton.py on CUDA; chosen in engine/forward/backends.py)."""

import torch
from torch import nn

from loragw.engine.forward.context import fused_elementwise
from loragw.engine.layers.parts import Loadable


class RMSNorm(nn.Module, Loadable):
    fusable = True  # Llama's formula is the fused kernels'

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def _fused(self, x: torch.Tensor):
        """The step's fused kernels if they take x, else None."""
        fused = fused_elementwise() if self.fusable and x.dim() == 2 else None
        return fused if fused is not None and fused.serves(x) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self._fused(x)
        if fused is not None:
            return fused.add_rms_norm(x, None, self.weight, self.eps)[1]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after a block and its norm: (x + delta, self(x + delta))."""
        fused = self._fused(x)
        if fused is not None and fused.serves(delta):
            return fused.add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is an offset from 1 and the scaling happens in float32
    before the cast back, (x * (1 + w)).to(dtype), where Llama casts first, x.to(dtype) * w."""

    fusable = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(dtype)
