"""RMSNorm, computed the way Hugging Face Llama and Gemma do (float32 statistics)."""

import torch
from torch import nn

from engine.layers.parts import Loadable


class RMSNorm(nn.Module, Loadable):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is an offset from 1 and the scaling happens in float32
    before the cast back, (x * (1 + w)).to(dtype), where Llama casts first, x.to(dtype) * w."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(dtype)
