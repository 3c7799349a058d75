"""What the loader and the model ask of the model's parts, declared once, with its defaults.

`Loadable`: every module that owns parameters. The loader (engine/models/loader.py) asks it which
checkpoint keys fill each of its parameters (`checkpoint_keys`) and which part of a checkpoint
tensor this rank holds (`checkpoint_part`). Defaults: the parameter's own name, and all of the
tensor (a replicated parameter: the norms). Linear (one key per merged slice, its rank's rows or
columns), VocabEmbedding / LMHead (their vocabulary rows) and Experts (one key per expert and
half, from a per-expert checkpoint) answer for themselves.

`Block`: a decoder layer and each block in it (attention, MLP, MoE block). It yields the
LoRA-ready Linears it holds, in a fixed order (`lora_linears`), and its Experts
(`expert_modules`): by default none of either (a dense MLP has no experts). The model's
lora_linears() and expert_modules() walk the layers once, asking each, and add the layer
index (engine/models/base.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


class Loadable:
    """Mixin of a module that owns parameters (engine/models/loader.py asks it)."""

    def checkpoint_keys(self, param_name: str) -> Iterator[str]:
        """The keys a checkpoint must fill for parameter `param_name` (its full name)."""
        yield param_name

    def checkpoint_part(self, slice_name: str | None, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor `full`, shaped as the checkpoint stores it, for
        slice `slice_name` of a merged Linear (None: the parameter is not merged)."""
        return full


class Block(nn.Module):
    """A decoder layer or one of its blocks: what the model asks of it."""

    def lora_linears(self) -> Iterator[nn.Module]:
        """The engine.layers.linear.Linear of every projection an adapter may adapt."""
        return iter(())

    def expert_modules(self) -> Iterator[nn.Module]:
        """Its engine.layers.moe.Experts (an MoE block's one; none elsewhere)."""
        return iter(())
