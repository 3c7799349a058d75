"""Linear projections that can carry a per-token LoRA delta.

One `Linear` may hold several output slices stacked along its rows (q|k|v, gate|up), loaded
from separately named checkpoint tensors. LoRA attaches by slice name: the adapter manager
sets `lora` to the projection's slot-pool buffers, and forward adds each token's own delta.

Under tensor parallelism (engine/distributed/shard.py) a Linear holds its rank's part: `sources`
names where each of its slices starts in the checkpoint's full tensor, along the output rows
(column-parallel) or the input columns (row_parallel). A row-parallel projection's partial
outputs are all-reduced; its LoRA delta is added before that, with A split by input columns
like the weight and B whole: the sum over ranks of (x_r A_r^T) B^T is x A^T B^T, so the delta
needs no collective of its own. The bias is added once, after the reduction.

The weight is one object of engine/layers/weights.py, which runs its matmul: dense; packed for
oneDNN once loaded on the CPU (`prepack`, when the model runner chose Backends.linear
"onednn"); or, for a quantized base's projection (`quantize(scheme)`, before loading), in
kernels/quant.py's layout, filled slice by slice. The LoRA delta is computed from the same
unquantized x and added to the output, as PEFT does on a dequantized base.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from loragw.engine.distributed import group
from loragw.engine.forward.context import get_forward_context
from loragw.engine.layers.parts import Loadable
from loragw.engine.layers.weights import DenseWeights, QuantizedWeights, Weights
from loragw.engine.quant import shard as quant_shard
from loragw.engine.quant.scheme import WeightScheme
from loragw.kernels import LoRAKernels
from loragw.kernels.quant import QuantWeight


@dataclass(slots=True)
class LoRABuffers:
    """A projection's device slot pool (see kernels.LoRAKernels.apply for the math)."""

    lora_a: torch.Tensor  # [n_slices, S, R, H]
    lora_b: torch.Tensor  # [S, O_total, R]
    ranks: torch.Tensor  # [n_slices, S] int32, 0 = nothing for that slice in that slot
    scales: torch.Tensor  # [n_slices, S] float32

    def apply(self, y: torch.Tensor, x: torch.Tensor, slice_offsets: tuple[int, ...], meta,
              kernels: LoRAKernels) -> None:
        """y += each row's own slot's delta (meta: a kernels.LoRAMeta over the rows of x)."""
        kernels.apply(y, x, self.lora_a, self.lora_b, self.ranks, self.scales, slice_offsets,
                      meta)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.lora_a, self.lora_b, self.ranks, self.scales))


class Linear(nn.Module, Loadable):
    def __init__(self, in_features: int, slices: dict[str, int], bias: bool = False, *,
                 sources: dict[str, int] | None = None, row_parallel: bool = False):
        """slices: this rank's output width of each slice; sources: where each starts in the
        checkpoint's tensor (column-parallel: its rows; row_parallel: {"*": first input
        column}); None: the whole tensor (one rank, or replicated)."""
        super().__init__()
        self.sources = sources
        self.row_parallel = row_parallel
        self.in_features = in_features
        self.slice_names = tuple(slices)
        # the adapter target (adapters.types) each slice's LoRA is keyed by: its slice name,
        # but "shared_expert.gate_proj" etc. on Qwen2-MoE's shared expert (engine/models/moe.py)
        self.lora_names = self.slice_names
        offsets = [0]
        for width in slices.values():
            offsets.append(offsets[-1] + width)
        self.slice_offsets = tuple(offsets)
        self.out_features = offsets[-1]
        self.bias = (nn.Parameter(torch.empty(self.out_features), requires_grad=False)
                     if bias else None)
        self.lora: LoRABuffers | None = None
        self.weights: Weights = DenseWeights(self.out_features, in_features)
        self._hold(self.weights)

    def _hold(self, weights: Weights) -> None:
        """Hold `weights`: its Parameters, and only its, registered as this module's."""
        for name in ("weight", "qweight"):
            self._parameters.pop(name, None)
        for name, param in weights.parameters().items():
            self.register_parameter(name, param)
        self.weights = weights

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # .to() / .to_empty(): new Parameters, the weights follow
        self.weights.rebind(self._parameters)
        return self

    def slice_rows(self, name: str) -> slice:
        i = self.slice_names.index(name)
        return slice(self.slice_offsets[i], self.slice_offsets[i + 1])

    def local(self, name: str, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part of slice `name`'s checkpoint-shaped tensor `full` (a weight, a bias
        or a LoRA factor), cut along `dim` if that is the dimension this Linear splits."""
        if self.sources is None or dim != (1 if self.row_parallel else 0) or full.dim() <= dim:
            return full
        if self.row_parallel:
            return full.narrow(dim, self.sources["*"], self.in_features)
        rows = self.slice_rows(name)
        return full.narrow(dim, self.sources[name], rows.stop - rows.start)

    def checkpoint_keys(self, param_name: str) -> Iterator[str]:
        """A merged Linear's parameter is filled slice by slice (`...qkv_proj.weight:k_proj`)."""
        if len(self.slice_names) == 1:
            yield param_name
        else:
            yield from (f"{param_name}:{name}" for name in self.slice_names)

    def checkpoint_part(self, slice_name: str | None, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint weight or bias, of slice `slice_name` (None: the
        only one)."""
        return self.local(slice_name or self.slice_names[0], full, 1 if self.row_parallel else 0)

    # ---- the weight's format ----------------------------------------------------------------
    def quantize(self, scheme: WeightScheme) -> None:
        """Hold this projection's weight quantized; on the meta device, before loading."""
        self._hold(QuantizedWeights(scheme, self.out_features, self.in_features,
                                    self.slice_names))

    def load_quant(self, slice_name: str | None, full: QuantWeight, name: str) -> None:
        """Fill slice `slice_name` (None: the only one) from checkpoint module `name`'s whole
        QuantWeight (this rank's part of it)."""
        slice_name = slice_name or self.slice_names[0]
        rows = self.slice_rows(slice_name)
        if self.sources is not None and self.row_parallel:
            part = quant_shard.columns(full, self.sources["*"], self.in_features, name)
        elif self.sources is not None:
            part = quant_shard.rows(full, self.sources[slice_name], rows.stop - rows.start)
        else:
            part = full
        self.weights.load(slice_name, rows, part, name)

    def prepack(self) -> None:
        """Hold the loaded weight in oneDNN's layout instead where it has one
        (kernels/cpu_linear.py)."""
        self._hold(self.weights.prepacked())

    def dense_weight(self) -> torch.Tensor:
        """The weight [O, I] as a plain tensor, however it is held (not quantized)."""
        return self.weights.dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> y: [T, O_total]
        y = self.weights.matmul(x, None if self.row_parallel else self.bias)
        if self.lora is not None:
            ctx = get_forward_context()
            if ctx.lora is not None and ctx.lora.tokens.has_lora:
                self.lora.apply(y, x, self.slice_offsets, ctx.lora.tokens,
                                ctx.backends.lora_kernels)
        if self.row_parallel:
            group.all_reduce(y)
            if self.bias is not None:
                y += self.bias
        return y
