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

from adapters.types import SHARED_EXPERT
from engine.layers.moe import PER_EXPERT, Routing, SparseMoeBlock
from engine.layers.norm import RMSNorm
from engine.layers.rotary import apply_rotary
from engine.models.llama import (
    MLP,
    Attention,
    DecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    ModelArgs,
)
from engine.parallel.shard import ONE, Shard

# model.layers.<i>.(mlp|block_sparse_moe).experts.<e>.<projection>.weight
PER_EXPERT_KEY = re.compile(r"(?P<layer>model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\."
                            r"(?P<expert>\d+)\.(?P<proj>\w+)\.weight")


@dataclass(frozen=True, kw_only=True)  # after ModelArgs's defaulted fields
class MoeArgs(ModelArgs):
    moe_intermediate_size: int
    shared_expert_intermediate_size: int  # 0: no shared expert
    sparse_layers: tuple[bool, ...]  # per layer: a SparseMoeBlock (else a dense MLP)
    routing: Routing
    qk_norm_whole: bool  # OLMoE: q/k RMSNorm over the whole projection
    clip_qkv: float | None

    @classmethod
    def from_hf_config(cls, cfg: dict) -> MoeArgs:
        base = ModelArgs.from_hf_config(cfg)
        arch = cfg["architectures"][0]
        _refuse_unsupported(cfg, arch)
        mixtral = arch == "MixtralForCausalLM"
        # transformers writes either name, whichever its config class maps to the other
        num_experts = next(cfg[k] for k in ("num_local_experts", "num_experts") if k in cfg)
        step = cfg.get("decoder_sparse_step", 1)
        dense_only = set(cfg.get("mlp_only_layers") or ())
        sparse = tuple(i not in dense_only and num_experts > 0 and (i + 1) % step == 0
                       for i in range(base.num_layers))
        routing = Routing(num_experts, cfg["num_experts_per_tok"],
                          norm_topk_prob=mixtral or bool(cfg.get("norm_topk_prob", False)),
                          float32_weights=mixtral)
        fields = {f: getattr(base, f) for f in ModelArgs.__dataclass_fields__}
        fields |= dict(attention_bias=(arch == "Qwen2MoeForCausalLM" and cfg.get("qkv_bias", True)),
                       qk_norm=arch == "Qwen3MoeForCausalLM")
        return cls(**fields,
                   moe_intermediate_size=cfg.get("moe_intermediate_size") or base.intermediate_size,
                   shared_expert_intermediate_size=(cfg.get("shared_expert_intermediate_size", 0)
                                                    if arch == "Qwen2MoeForCausalLM" else 0),
                   sparse_layers=sparse, routing=routing,
                   qk_norm_whole=arch == "OlmoeForCausalLM", clip_qkv=cfg.get("clip_qkv"))


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


class WholeQKNormAttention(Attention):
    """OLMoE's attention: RMSNorm over all of q and all of k, then optional clipping of q/k/v."""

    def __init__(self, args: MoeArgs, shard: Shard):
        super().__init__(args, shard)
        self.q_norm = RMSNorm(self.num_heads * self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.num_kv_heads * self.head_dim, args.rms_norm_eps)
        self.clip_qkv = args.clip_qkv

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)  # [T, n_heads * D], [T, n_kv * D]
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, *rope)
        return self.o_proj(self.attn(q, k, v))


class MoeDecoderLayer(nn.Module):
    def __init__(self, args: MoeArgs, index: int, shard: Shard):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = (WholeQKNormAttention if args.qk_norm_whole else Attention)(args, shard)
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
    logits are Llama's; the expert and LoRA maps below are the MoE's own."""

    def __init__(self, hf_config: dict, shard: Shard = ONE):
        if shard.size > 1:
            raise ValueError(f"{hf_config['architectures'][0]}: Mixture-of-Experts bases are not "
                             "split across ranks; serve them with tensor_parallel_size 1")
        super().__init__(hf_config, shard)

    @classmethod
    def make_args(cls, hf_config: dict) -> MoeArgs:
        return MoeArgs.from_hf_config(hf_config)

    def make_model(self, hf_config: dict, shard: Shard) -> nn.Module:
        layers = [MoeDecoderLayer(self.args, i, shard) for i in range(self.args.num_layers)]
        return LlamaModel(self.args, hf_config, shard, layers)

    def expert_modules(self):
        """(layer index, Experts) of every sparse layer."""
        for index, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                yield index, layer.mlp.experts

    def lora_linears(self):
        """(layer index, Linear) of every projection an adapter may adapt: attention, dense
        MLPs, the router, the shared expert and its gate (experts: expert_modules)."""
        for index, layer in enumerate(self.model.layers):
            yield index, layer.self_attn.qkv_proj
            yield index, layer.self_attn.o_proj
            mlp = layer.mlp
            if isinstance(mlp, SparseMoeBlock):
                yield index, mlp.gate
                if hasattr(mlp, "shared_expert"):
                    yield index, mlp.shared_expert.gate_up_proj
                    yield index, mlp.shared_expert.down_proj
                    yield index, mlp.shared_expert_gate
            else:
                yield index, mlp.gate_up_proj
                yield index, mlp.down_proj

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
