"""How a projection holds its weight [O, I], one object per format, each with the matmul it runs:

    DenseWeights      a Parameter `weight`, as the checkpoint gives it       F.linear
    PackedWeights     oneDNN's layout of a loaded dense weight (CPU)        cpu_linear
    QuantizedWeights  a Parameter `qweight` in kernels/quant.py's layout,   the GEMM the model
                      its scales, zero points, act-order map and input      runner chose
                      quantization gathered per slice, joined once every    (Backends.quant_linear)
                      slice is in

A Linear (engine/layers/linear.py) holds exactly one and registers the Parameters it names as
its own (`parameters()`), so checkpoint keys stay `...qkv_proj.weight` / `...qkv_proj.qweight`.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from loragw.engine.distributed import group
from loragw.engine.forward.context import get_forward_context
from loragw.engine.quant.scheme import WeightScheme
from loragw.kernels import cpu_linear
from loragw.kernels.act_quant import join_static, quantize_activations
from loragw.kernels.quant import QuantWeight


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Weights:
    """The interface every format keeps."""

    scheme: WeightScheme | None = None  # the quantization scheme (None: floating point)

    def parameters(self) -> dict[str, nn.Parameter]:
        """What the Linear registers under its own name (the loader fills these)."""
        return {}

    def rebind(self, params: dict[str, nn.Parameter]) -> None:
        """Take the Linear's Parameters again: `.to()` and `.to_empty()` replace them."""

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [T, I] -> x @ W.T (+ bias): [T, O]."""
        raise NotImplementedError

    def dense(self) -> torch.Tensor:
        """The weight [O, I] as a plain tensor."""
        raise NotImplementedError

    @property
    def num_bytes(self) -> int:
        """Bytes held, as stored."""
        raise NotImplementedError

    def prepacked(self) -> Weights:
        """These weights in oneDNN's layout where that applies (a loaded dense weight), else
        themselves."""
        return self


class DenseWeights(Weights):
    def __init__(self, out_features: int, in_features: int):
        self.weight = _frozen(torch.empty(out_features, in_features))

    def parameters(self) -> dict[str, nn.Parameter]:
        return {"weight": self.weight}

    def rebind(self, params: dict[str, nn.Parameter]) -> None:
        self.weight = params["weight"]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def dense(self) -> torch.Tensor:
        return self.weight

    @property
    def num_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def prepacked(self) -> Weights:
        return PackedWeights(self.weight)


class PackedWeights(Weights):
    """A loaded dense weight in oneDNN's layout (kernels/cpu_linear.py); nothing to load."""

    def __init__(self, dense: torch.Tensor):
        self.packed = cpu_linear.pack(dense)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_linear.packed_linear(x, self.packed, bias)

    def dense(self) -> torch.Tensor:
        return self.packed.to_dense()

    @property
    def num_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


class QuantizedWeights(Weights):
    """Built on the meta device before loading (engine/models/loader.py); `load` fills it
    slice by slice, and the slices' QuantWeights are joined into `quant` once all are in."""

    def __init__(self, scheme: WeightScheme, out_features: int, in_features: int,
                 slices: tuple[str, ...]):
        packed = -(-in_features // 2) if scheme.kind == "int4" else in_features
        dtype = torch.int8 if scheme.kind == "int8" else torch.uint8
        self.qweight = _frozen(torch.empty(out_features, packed, dtype=dtype))
        self.scheme, self.in_features, self.slices = scheme, in_features, slices
        self.quant: QuantWeight | None = None  # once every slice is loaded
        self._parts: dict[str, QuantWeight] = {}  # slice -> its loaded part

    def parameters(self) -> dict[str, nn.Parameter]:
        return {"qweight": self.qweight}

    def rebind(self, params: dict[str, nn.Parameter]) -> None:
        assert self.quant is None, "a loaded quantized weight is not moved"
        self.qweight = params["qweight"]

    def load(self, slice_name: str, rows: slice, part: QuantWeight, name: str) -> None:
        """Fill slice `slice_name` (rows `rows` of qweight) from `part`, this rank's share of
        checkpoint module `name`'s QuantWeight."""
        if part.qweight.shape != self.qweight[rows].shape or part.kind != self.scheme.kind:
            raise ValueError(f"checkpoint module {name!r} holds {part.kind} "
                             f"{tuple(part.qweight.shape)} packed, the model expects "
                             f"{self.scheme.kind} {tuple(self.qweight[rows].shape)}")
        self.qweight[rows].copy_(part.qweight)
        self._parts[slice_name] = part
        if len(self._parts) == len(self.slices):
            self.quant = self._joined()

    def _joined(self) -> QuantWeight:
        """The slices' scales, zero points and act-order maps as one QuantWeight."""
        parts = [self._parts.pop(name) for name in self.slices]
        device = self.qweight.device
        if len({p.scales.shape[1] for p in parts}) > 1 or len({p.group_size for p in parts}) > 1:
            raise ValueError(f"the slices {', '.join(self.slices)} of one merged projection "
                             "are quantized with different groups")
        zeros = None
        if any(p.zeros is not None for p in parts):
            zeros = torch.cat([p.zeros if p.zeros is not None else
                               torch.zeros_like(p.scales, dtype=torch.int8) for p in parts])
        g_idx = row_slice = None
        if any(p.g_idx is not None for p in parts):
            plain = (torch.arange(self.in_features) // parts[0].group_size).to(torch.int32)
            g_idx = torch.cat([p.g_idx if p.g_idx is not None else plain[None] for p in parts])
            row_slice = torch.cat([torch.full((p.out_features,), i, dtype=torch.int32)
                                   for i, p in enumerate(parts)])
        scales = torch.cat([p.scales for p in parts])
        # static input scales stay each slice's own (kernels/act_quant.py says why)
        act = join_static([(p.act, p.out_features) for p in parts])
        quant = QuantWeight(self.scheme.kind, self.qweight, scales.to(device),
                            None if zeros is None else zeros.to(device), parts[0].group_size,
                            self.in_features, None if g_idx is None else g_idx.to(device),
                            None if row_slice is None else row_slice.to(device),
                            None if act is None else act.to(device))
        quant.check()
        return quant

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        quant_linear = get_forward_context().backends.quant_linear
        act = self.quant.act
        if act is not None and act.spans_ranks:
            # a row-parallel rank: each token's scale needs the other ranks' columns too, so
            # x is quantized here, where the collective is, and the GEMM runs weight-only
            x = quantize_activations(x, act, _all_reduce_max)
            return quant_linear(x, replace(self.quant, act=None), bias)
        return quant_linear(x, self.quant, bias)

    def dense(self) -> torch.Tensor:
        raise ValueError("a quantized projection has no dense weight; dequantize its QuantWeight")

    @property
    def num_bytes(self) -> int:
        return self.quant.num_bytes if self.quant is not None else 0


def _all_reduce_max(t: torch.Tensor) -> None:
    """t maxed over the tensor-parallel ranks, in place (group.all_reduce sums)."""
    if group.shard().size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
