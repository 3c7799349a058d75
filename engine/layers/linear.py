"""Linear projections that can carry a per-token LoRA delta.

One `Linear` may hold several output slices stacked along its rows (q|k|v, gate|up), loaded
from separately named checkpoint tensors. LoRA attaches by slice name: the adapter manager
sets `lora` to the projection's slot-pool buffers, and forward adds each token's own delta.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_context import get_forward_context
from kernels import apply_lora


@dataclass(slots=True)
class LoRABuffers:
    """A projection's device slot pool (see kernels.apply_lora for the math)."""

    lora_a: torch.Tensor  # [n_slices, S, R, H]
    lora_b: torch.Tensor  # [S, O_total, R]
    ranks: torch.Tensor  # [n_slices, S] int32, 0 = nothing for that slice in that slot
    scales: torch.Tensor  # [n_slices, S] float32

    def apply(self, y: torch.Tensor, x: torch.Tensor, slice_offsets: tuple[int, ...], meta,
              backend: str) -> None:
        """y += each row's own slot's delta (meta: a kernels.LoRAMeta over the rows of x)."""
        apply_lora(y, x, self.lora_a, self.lora_b, self.ranks, self.scales, slice_offsets, meta,
                   backend=backend)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.lora_a, self.lora_b, self.ranks, self.scales))


class Linear(nn.Module):
    def __init__(self, in_features: int, slices: dict[str, int], bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.slice_names = tuple(slices)
        offsets = [0]
        for width in slices.values():
            offsets.append(offsets[-1] + width)
        self.slice_offsets = tuple(offsets)
        self.out_features = offsets[-1]
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(self.out_features), requires_grad=False)
                     if bias else None)
        self.lora: LoRABuffers | None = None

    def slice_rows(self, name: str) -> slice:
        i = self.slice_names.index(name)
        return slice(self.slice_offsets[i], self.slice_offsets[i + 1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> y: [T, O_total]
        y = F.linear(x, self.weight, self.bias)
        if self.lora is not None:
            ctx = get_forward_context()
            if ctx.lora is not None and ctx.lora.tokens.has_lora:
                self.lora.apply(y, x, self.slice_offsets, ctx.lora.tokens,
                                ctx.backends.lora)
        return y
