"""RMSNorm, computed the way Hugging Face Llama and Gemma do (float32 statistics). Llama's
over a layer's rows [T, H] runs as the step's Elementwise chose (engine/forward/elementwise.py:
one fused kernel where the engine has one); a per-head q/k norm [T, n, D] as torch's ops."""

import torch
from torch import nn

from loragw.engine.forward.context import elementwise
from loragw.engine.forward.elementwise import rms_norm
from loragw.engine.layers.parts import Loadable


class RMSNorm(nn.Module, Loadable):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return rms_norm(x, self.weight, self.eps)
        return elementwise().add_rms_norm(x, None, self.weight, self.eps)[1]

    def add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after a block and its norm: (x + delta, self(x + delta))."""
        return elementwise().add_rms_norm(x, delta, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is an offset from 1 and the scaling happens in float32
    before the cast back, (x * (1 + w)).to(dtype), where Llama casts first, x.to(dtype) * w."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(dtype)

    def add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + delta
        return x, self(x)
