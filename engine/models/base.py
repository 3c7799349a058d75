"""`CausalLM`: the contract every served model keeps (engine/models/__init__.py lists it), as
code with its defaults; a family overrides what differs. And `adapter_spec`: what the model
offers adapters (adapters.types.BaseModelSpec), derived from the same args the model is built
from, so what adapters are checked against is what the engine serves.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from torch import nn

from loragw.adapters.types import EMBED_TOKENS, LM_HEAD, BaseModelSpec, base_name
from loragw.engine.distributed.shard import ONE, Shard
from loragw.engine.layers.attention import PagedAttention
from loragw.engine.layers.embedding import LMHead
from loragw.engine.layers.linear import Linear
from loragw.engine.layers.moe import Experts
from loragw.engine.layers.parts import Block
from loragw.engine.models.args import ModelArgs
from loragw.kernels import cpu_linear

Fused = dict[str, tuple[tuple[str, int], ...]]  # module -> (slice, its rows) of each slice


class Layer(Block):
    """A decoder layer: `self_attn` (engine/models/llama.py's Attention) and `mlp` (an MLP or
    an MoE block); it yields their Linears, attention's first, and the MLP's Experts."""

    def lora_linears(self) -> Iterator[Linear]:
        yield from self.self_attn.lora_linears()
        yield from self.mlp.lora_linears()

    def expert_modules(self) -> Iterator[Experts]:
        return self.mlp.expert_modules()


class CausalLM(nn.Module):
    """args; model: the backbone (embed_tokens, layers: Layers, norm, rotary_emb); lm_head.
    Built on any device (the meta device first), filled by engine/models/loader.py."""

    # checkpoint name fragment -> (our merged module, its slice): none here (Llama's: llama.py)
    merged_projections: dict[str, tuple[str, str]] = {}
    # checkpoint module holding several of our slices -> those slices, in row order (Phi-3's)
    fused_modules: dict[str, tuple[str, ...]] = {}

    def __init__(self, args: ModelArgs, shard: Shard = ONE):
        super().__init__()
        self.args = args
        self.shard = shard
        # checkpoint module -> its slices in row order, each (slice name, rows in the checkpoint)
        self.fused_projections = fused_layout(self.fused_modules, self.args)
        self.model = self.make_model(shard)
        # tied: no weight of its own ("lm_head.weight" is not a parameter), only its LoRA pool
        self.lm_head = LMHead(self.args.hidden_size, self.args.vocab_size, shard,
                              tied_to=self.model.embed_tokens if self.args.tie_word_embeddings
                              else None)

    @classmethod
    def make_args(cls, hf_config: dict) -> ModelArgs:
        """The family's args, read from the config.json dict; the model and its adapter spec
        are both built from them."""
        raise NotImplementedError

    def make_model(self, shard: Shard) -> nn.Module:
        """The backbone, from self.args: embed_tokens, layers, norm, rotary_emb."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [B, hidden], the sampling rows -> logits: [B, vocab] (float32 for the sampler)
        return self.lm_head(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def checkpoint_target(self, name: str) -> tuple[torch.Tensor, str] | None:
        """For the loader: a family's own placement of checkpoint tensor `name` (our tensor, the
        key it fills), or None for the merged/fused/plain rules (MoE's per-expert tensors)."""
        return None

    def lora_linears(self) -> Iterator[tuple[int, Linear]]:
        """(layer index, Linear) of every projection an adapter may adapt, layer by layer."""
        for index, layer in enumerate(self.model.layers):
            for linear in layer.lora_linears():
                yield index, linear

    def expert_modules(self) -> Iterator[tuple[int, Experts]]:
        """(layer index, Experts) of every sparse layer: none in a dense model."""
        for index, layer in enumerate(self.model.layers):
            for experts in layer.expert_modules():
                yield index, experts

    def parameter_counts(self) -> tuple[int, int]:
        """(total, active) parameters, active being what one token's forward pass multiplies
        by: all of them in a dense model (MoE: only top_k of each layer's E experts)."""
        linears, own = self._projection_weights()
        total = sum(p.numel() for p in self.parameters() if id(p) not in own)
        total += sum(m.out_features * m.in_features for m in linears)  # however each is held
        return total, total

    def prepack(self, every: bool = False) -> None:
        """Dense projections and lm_head in oneDNN's layout (kernels/cpu_linear.py): those
        large enough for it to pay, or `every` one."""
        for module in self.modules():
            if isinstance(module, Linear):
                shape = (module.out_features, module.in_features)
            elif isinstance(module, LMHead):
                shape = (module.local_vocab, module.hidden_size)
            else:
                continue
            if every or cpu_linear.worth_packing(*shape):
                module.prepack()

    def weight_bytes(self) -> int:
        """Bytes this process holds of the base's weights: parameters as they are stored
        (a quantized projection's packed qweight, a projection's oneDNN layout, lm_head's
        beside its weight) and its quantization's scales, zero points and act-order maps."""
        linears, own = self._projection_weights()
        held = sum(p.numel() * p.element_size() for p in self.parameters() if id(p) not in own)
        held += sum(m.weights.num_bytes for m in linears)
        held += sum(m.packed.numel() * m.packed.element_size() for m in self.modules()
                    if isinstance(m, LMHead) and m.packed is not None)
        return held

    def _projection_weights(self) -> tuple[list[Linear], set[int]]:
        """Every Linear, and the ids of the Parameters their weights register (counted by
        the weights themselves, however they are held)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        return linears, {id(p) for m in linears for p in m.weights.parameters().values()}

    @classmethod
    def adapter_spec(cls, args: ModelArgs, max_lora_rank: int, max_full_module_slots: int = 0,
                     model_path: str | os.PathLike | None = None,
                     dtype: str = "float32") -> BaseModelSpec:
        """What this base offers adapters (model_path: the served directory, for its name;
        dtype: the served dtype's name), from the args the model is built from."""
        if max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {max_lora_rank}")
        fused = fused_layout(cls.fused_modules, args)
        hidden, vocab = args.hidden_size, args.vocab_size
        shapes = fuse(args.projection_shapes(), fused)
        shapes |= {EMBED_TOKENS: (hidden, vocab), LM_HEAD: (vocab, hidden)}
        names = [os.path.basename(os.path.abspath(model_path))] if model_path else []
        if args.name_or_path is not None:
            names.append(args.name_or_path)
        names = tuple(dict.fromkeys(n for n in names if base_name(n)))  # distinct, in order
        return BaseModelSpec(args.num_layers, shapes, max_lora_rank, args.tie_word_embeddings,
                             max_full_module_slots, args.architecture, names, dtype, fused,
                             args.num_experts, args.moe_layers)


def fused_layout(modules: dict[str, tuple[str, ...]], args: ModelArgs) -> Fused:
    """Each fused checkpoint module's slices with their rows (qkv_proj: q, k, v rows)."""
    shapes = args.projection_shapes()
    return {module: tuple((part, shapes[part][0]) for part in parts)
            for module, parts in modules.items()}


def fuse(shapes: dict[str, tuple[int, int]], fused: Fused) -> dict[str, tuple[int, int]]:
    """`shapes` with the slices of each fused module replaced by the module, where its first
    slice was (Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj)."""
    into = {part: module for module, slices in fused.items() for part, _ in slices}
    out: dict[str, tuple[int, int]] = {}
    for target, (rows, columns) in shapes.items():
        module = into.get(target)
        if module is None:
            out[target] = (rows, columns)
        elif module not in out:
            out[module] = (sum(n for _, n in fused[module]), columns)
    return out

