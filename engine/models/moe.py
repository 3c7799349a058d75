"""Mixture-of-Experts bases: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE, from config.json alone.

Attention, norms, rotary and dense MLPs are the Llama family's (engine/models/llama.py); the
feed-forward of a sparse layer is engine/layers/moe.py's SparseMoeBlock. The differences:
    Mixtral     every layer sparse, top-k weights always renormalised (and kept float32)
    Qwen2-MoE   q/k/v biases; a shared expert with a sigmoid gate; decoder_sparse_step and
                mlp_only_layers choose the sparse layers, the others are dense MLPs
                (intermediate_size; sparse layers' experts use moe_intermediate_size)
    Qwen3-MoE   per-head q/k RMSNorm; decoder_sparse_step, mlp_only_layers, norm_topk_prob
    OLMoE       q/k RMSNorm over the whole projection (before the head split); clip_qkv
Checkpoints hold experts either per expert (`experts.<e>.w1` / `gate_proj`, as save_pretrained
writes them, under `block_sparse_moe` in Mixtral's) or fused (`experts.gate_up_proj`,
`experts.down_proj`); both load into the fused layout (`checkpoint_target`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
from torch import nn

from loragw.adapters.types import EXPERT_TARGETS, ROUTER, SHARED_EXPERT, SHARED_TARGETS
from loragw.engine.distributed.shard import ONE, Shard
from loragw.engine.layers.moe import PER_EXPERT, Routing, SparseMoeBlock
from loragw.engine.layers.norm import RMSNorm
from loragw.engine.models.args import ModelArgs, architecture, positive
from loragw.engine.models.base import Layer
from loragw.engine.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, LlamaModel

QK_NORMS = {"Qwen3MoeForCausalLM": "head", "OlmoeForCausalLM": "whole"}  # ModelArgs.qk_norm
# model.layers.<i>.(mlp|block_sparse_moe).experts.<e>.<projection>.weight
PER_EXPERT_KEY = re.compile(r"(?P<layer>model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\."
                            r"(?P<expert>\d+)\.(?P<proj>\w+)\.weight")


@dataclass(frozen=True, kw_only=True)  # after ModelArgs's defaulted fields
class MoeArgs(ModelArgs):
    moe_intermediate_size: int
    shared_expert_intermediate_size: int  # 0: no shared expert
    sparse_layers: tuple[bool, ...]  # per layer: a SparseMoeBlock (else a dense MLP)
    routing: Routing

    @classmethod
    def from_hf_config(cls, cfg: dict) -> MoeArgs:
        base = ModelArgs.from_hf_config(cfg)
        arch = architecture(cfg)
        _refuse_unsupported(cfg, arch)
        mixtral = arch == "MixtralForCausalLM"
        # transformers writes either name, whichever its config class maps to the other
        num_experts = positive(cfg, "num_local_experts" if cfg.get("num_local_experts")
                               else "num_experts")
        step = cfg.get("decoder_sparse_step") or 1
        dense_only = set(cfg.get("mlp_only_layers") or ())
        sparse = tuple(i not in dense_only and (i + 1) % step == 0
                       for i in range(base.num_layers))
        routing = Routing(num_experts, positive(cfg, "num_experts_per_tok"),
                          norm_topk_prob=mixtral or bool(cfg.get("norm_topk_prob", False)),
                          float32_weights=mixtral)
        fields = {f: getattr(base, f) for f in ModelArgs.__dataclass_fields__}
        fields |= dict(attention_bias=(arch == "Qwen2MoeForCausalLM" and cfg.get("qkv_bias", True)),
                       qk_norm=QK_NORMS.get(arch), clip_qkv=cfg.get("clip_qkv"))
        shared = (cfg.get("shared_expert_intermediate_size") or 0
                  if arch == "Qwen2MoeForCausalLM" else 0)
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise ValueError(f"base model config.json: shared_expert_intermediate_size is "
                             f"{shared!r}, not an int >= 0 (0: no shared expert)")
        inter = (positive(cfg, "moe_intermediate_size") if cfg.get("moe_intermediate_size")
                 else base.intermediate_size)  # Mixtral's and OLMoE's experts: intermediate_size
        return cls(**fields, moe_intermediate_size=inter,
                   shared_expert_intermediate_size=shared, sparse_layers=sparse, routing=routing)

    @property
    def num_experts(self) -> int:
        return self.routing.num_experts

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, sparse in enumerate(self.sparse_layers) if sparse)

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """Llama's, then the router's [E, H], one expert's gate_up [2I, H] and down [H, I]
        (of moe_intermediate_size I), and a shared expert's [S, H] ... with its gate [1, H]."""
        shapes = super().projection_shapes()
        hidden, inter = self.hidden_size, self.moe_intermediate_size
        gate_up, down = EXPERT_TARGETS
        shapes |= {ROUTER: (self.num_experts, hidden), gate_up: (2 * inter, hidden),
                   down: (hidden, inter)}
        if shared := self.shared_expert_intermediate_size:
            s_gate, s_up, s_down, s_sg = SHARED_TARGETS
            shapes |= {s_gate: (shared, hidden), s_up: (shared, hidden),
                       s_down: (hidden, shared), s_sg: (1, hidden)}
        return shapes


def _refuse_unsupported(cfg: dict, arch: str) -> None:
    """Config switches this engine does not implement fail at start-up, named."""
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (only silu)")
    if cfg.get("attention_bias") and arch != "Qwen2MoeForCausalLM":
        problems.append("attention_bias true (o_proj bias is not implemented)")
    if cfg.get("use_sliding_window") or (arch == "MixtralForCausalLM" and cfg.get("sliding_window")):
        problems.append("sliding-window attention")
    if cfg.get("scoring_func", "softmax") != "softmax":
        problems.append(f"router scoring_func {cfg['scoring_func']!r}")
    if problems:
        raise ValueError(f"{arch} checkpoint sets what this engine does not implement: "
                         f"{'; '.join(problems)}; serve a checkpoint without it")


class MoeDecoderLayer(Layer):
    def __init__(self, args: MoeArgs, index: int, shard: Shard):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, shard)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if not args.sparse_layers[index]:
            self.mlp = MLP(args, shard)
            return
        shared = None
        if args.shared_expert_intermediate_size:
            shared = MLP(replace(args, intermediate_size=args.shared_expert_intermediate_size),
                         shard)
            for linear in (shared.gate_up_proj, shared.down_proj):
                linear.lora_names = tuple(f"{SHARED_EXPERT}.{s}" for s in linear.slice_names)
        self.mlp = SparseMoeBlock(args.hidden_size, args.moe_intermediate_size, args.routing,
                                  shared)

    forward = DecoderLayer.forward  # pre-norm residual blocks, as Llama's


class MoeForCausalLM(LlamaForCausalLM):
    """Llama's model with MoeDecoderLayers: checkpoint names, attention layers, forward and
    logits are Llama's (the layers yield their router, shared expert and Experts); the parameter
    counts and the per-expert checkpoint placement below are the MoE's own."""

    def __init__(self, args: MoeArgs, shard: Shard = ONE):
        if shard.size > 1:
            raise ValueError(f"{args.architecture}: Mixture-of-Experts bases are not "
                             "split across ranks; serve them with tensor_parallel_size 1")
        super().__init__(args, shard)

    @classmethod
    def make_args(cls, hf_config: dict) -> MoeArgs:
        return MoeArgs.from_hf_config(hf_config)

    def make_model(self, shard: Shard) -> nn.Module:
        layers = [MoeDecoderLayer(self.args, i, shard) for i in range(self.args.num_layers)]
        return LlamaModel(self.args, shard, layers)

    def parameter_counts(self) -> tuple[int, int]:
        """(total, active): of each sparse layer's experts only top_k of E are active."""
        total, _ = super().parameter_counts()
        r = self.args.routing
        inactive = sum(sum(p.numel() for p in experts.parameters())
                       * (r.num_experts - r.top_k) // r.num_experts
                       for _, experts in self.expert_modules())
        return total, total - inactive

    def checkpoint_target(self, name: str) -> tuple[torch.Tensor, str] | None:
        """For the loader: where a per-expert or Mixtral `block_sparse_moe` checkpoint tensor
        goes (our tensor to copy into, the key it fills), or None for an ordinary name."""
        if m := PER_EXPERT_KEY.fullmatch(name):
            param, half = PER_EXPERT.get(m["proj"], (None, None))
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r}: unknown expert projection")
            experts = self.get_submodule(f"{m['layer']}.mlp.experts")
            expert = int(m["expert"])
            target = experts.per_expert_target(param, expert, half)
            key = f"{m['layer']}.mlp.experts.{param}:{expert}:"
            return target, key + ("down_proj" if half is None else ("gate_proj", "up_proj")[half])
        if ".block_sparse_moe." in name:
            ours = name.replace(".block_sparse_moe.", ".mlp.")
            return self.get_parameter(ours), ours
        return None


# config.json "architectures" -> the class that serves it (engine/models/__init__.py)
ARCHITECTURES = {name: MoeForCausalLM for name in (
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")}
