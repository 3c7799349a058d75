"""The Llama family (Llama, Mistral, Qwen2, Qwen3) as one model.

Differences are config switches: Qwen2 adds q/k/v biases, Qwen3 adds per-head q/k RMSNorm,
Mistral (`sliding_window`) and Qwen2 (`use_sliding_window`) may slide some layers' attention.
Projections are merged (qkv_proj, gate_up_proj) with named output slices, so checkpoint
tensors and LoRA adapters attach by their Hugging Face names; embed_tokens and lm_head carry
LoRAs too (engine/layers/embedding.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention import PagedAttention
from engine.layers.embedding import LMHead, VocabEmbedding
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.parallel.shard import ONE, Shard


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_windows: tuple[int | None, ...] = ()  # per layer: its sliding window, None = full

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArgs:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else cfg.get("model_type", "?")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            layer_windows=layer_windows(cfg, arch),
        )


def layer_windows(cfg: dict, arch: str) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers decides it: `layer_types` when config.json
    names them; else Mistral and Phi-3 slide every layer when `sliding_window` is set, Qwen2/3 the layers
    from `max_window_layers` on when `use_sliding_window` is true."""
    num_layers, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if window is None:
        return (None,) * num_layers
    if cfg.get("layer_types"):
        return tuple(window if kind == "sliding_attention" else None for kind in cfg["layer_types"])
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        return (window,) * num_layers
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window"):
        first = cfg.get("max_window_layers", 28)
        return tuple(window if i >= first else None for i in range(num_layers))
    return (None,) * num_layers


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, shard: Shard, *, scale: float | None = None,
                 sliding_window: int | None = None, softcap: float | None = None,
                 norm: type[nn.Module] = RMSNorm):
        """scale: of the scores (default head_dim ** -0.5); norm: the q/k norm's class."""
        super().__init__()
        d = args.head_dim
        q0, heads = shard.split(args.num_heads, "num_attention_heads")
        kv0, kv_heads = shard.kv_heads(args.num_heads, args.num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, d
        tp = shard.size > 1
        self.qkv_proj = Linear(args.hidden_size, {"q_proj": heads * d, "k_proj": kv_heads * d,
                                                  "v_proj": kv_heads * d},
                               bias=args.attention_bias,
                               sources=dict(q_proj=q0 * d, k_proj=kv0 * d, v_proj=kv0 * d)
                               if tp else None)
        self.o_proj = Linear(heads * d, {"o_proj": args.hidden_size},
                             sources={"*": q0 * d} if tp else None, row_parallel=tp)
        if args.qk_norm:
            self.q_norm = norm(d, args.rms_norm_eps)
            self.k_norm = norm(d, args.rms_norm_eps)
        self.attn = PagedAttention(heads, kv_heads, d, scale=d ** -0.5 if scale is None else scale,
                                   sliding_window=sliding_window, softcap=softcap)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]  rope: (cos, sin) [T, 1, D] each
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, n_heads, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, n_kv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        return self.o_proj(self.attn(q, k, v))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, shard: Shard,
                 act: Callable[[torch.Tensor], torch.Tensor] = F.silu):
        super().__init__()
        self.act = act  # SwiGLU; Gemma's GeGLU passes gelu
        i0, inter = shard.split(args.intermediate_size, "intermediate_size")
        tp = shard.size > 1
        self.gate_up_proj = Linear(args.hidden_size, {"gate_proj": inter, "up_proj": inter},
                                   sources=dict(gate_proj=i0, up_proj=i0) if tp else None)
        self.down_proj = Linear(inter, {"down_proj": args.hidden_size},
                                sources={"*": i0} if tp else None, row_parallel=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, shard: Shard, window: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, shard, sliding_window=window)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args, shard)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, hf_config: dict, shard: Shard,
                 layers: list[nn.Module] | None = None):
        """layers: a family's own decoder layers (MoE's), else Llama's."""
        super().__init__()
        self.embed_tokens = VocabEmbedding(args.vocab_size, args.hidden_size, shard)
        self.layers = nn.ModuleList(layers if layers is not None else (
            DecoderLayer(args, shard, window) for window in args.layer_windows))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args.head_dim, hf_config)  # shared by every layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(rope, x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our module name, slice name)
    merged_projections = {"q_proj": ("qkv_proj", "q_proj"), "k_proj": ("qkv_proj", "k_proj"),
                          "v_proj": ("qkv_proj", "v_proj"), "gate_proj": ("gate_up_proj", "gate_proj"),
                          "up_proj": ("gate_up_proj", "up_proj")}
    # checkpoint module holding several of our slices -> ((slice, rows), ...): none (phi3.py)
    fused_projections: dict[str, tuple[tuple[str, int], ...]] = {}

    def __init__(self, hf_config: dict, shard: Shard = ONE):
        super().__init__()
        self.args = self.make_args(hf_config)
        self.shard = shard
        self.model = self.make_model(hf_config, shard)
        # tied: no weight of its own ("lm_head.weight" is not a parameter), only its LoRA pool
        self.lm_head = LMHead(self.args.hidden_size, self.args.vocab_size, shard,
                              tied_to=self.model.embed_tokens if self.args.tie_word_embeddings
                              else None)

    @classmethod
    def make_args(cls, hf_config: dict) -> ModelArgs:
        return ModelArgs.from_hf_config(hf_config)

    def make_model(self, hf_config: dict, shard: Shard) -> nn.Module:
        """The backbone: embed_tokens, layers, norm, rotary_emb (a family's own, e.g. Gemma)."""
        return LlamaModel(self.args, hf_config, shard)

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

    def lora_linears(self):
        """(layer index, Linear) of every projection an adapter may adapt."""
        for index, layer in enumerate(self.model.layers):
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                           layer.mlp.gate_up_proj, layer.mlp.down_proj):
                yield index, linear


# config.json "architectures" -> the class that serves it (engine/models/__init__.py)
ARCHITECTURES = {name: LlamaForCausalLM for name in (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")}
