"""Gemma 2 and Gemma 3 (text) on the Llama family's blocks.

What Gemma changes (checked against transformers' modeling_gemma2.py / modeling_gemma3.py):
    embeddings    scaled by sqrt(hidden), the factor rounded to the served dtype first
    MLP           GeGLU: gelu (tanh approximation) on the gate instead of silu
    norms         RMSNorm as x * (1 + w) in float32 (GemmaRMSNorm); four per layer: around
                  attention (input, post_attention) and around the MLP (pre_ / post_feedforward)
    attention     scale query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps the scores
                  (attn_logit_softcapping); Gemma 3 RMSNorms q and k per head before rope and
                  caps no scores: its config keeps the key, but transformers' Gemma 3
                  attention never passes it on (qk-norm took its place), so neither do we
    layer kinds   "sliding_attention" layers see the last `sliding_window` keys only, the others
                  everything: `layer_types` in config.json, else Gemma 2 alternates (layer 0
                  slides) and Gemma 3 makes every sliding_window_pattern-th layer (6) full
    rope          Gemma 3: sliding layers use rope_local_base_freq (10k) and no scaling, full
                  layers rope_theta (1M) with rope_scaling
    logits        soft-capped (final_logit_softcapping: Gemma 2's 30; Gemma 3 none by default)
    lm_head       tied to embed_tokens unless config.json says otherwise
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from loragw.engine.distributed.shard import Shard
from loragw.engine.layers.embedding import VocabEmbedding
from loragw.engine.layers.norm import GemmaRMSNorm
from loragw.engine.layers.rotary import RopeArgs, RotaryEmbedding
from loragw.engine.models.args import ModelArgs, architecture, read_rope
from loragw.engine.models.base import Layer
from loragw.engine.models.llama import MLP, Attention, LlamaForCausalLM

SLIDING, FULL = "sliding_attention", "full_attention"
ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# transformers' config defaults where config.json leaves a key out
DEFAULTS = {
    "Gemma2ForCausalLM": dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              sliding_window=4096, sliding_window_pattern=2),
    "Gemma3ForCausalLM": dict(final_logit_softcapping=None,
                              sliding_window=4096, sliding_window_pattern=6),
}


@dataclass(frozen=True)
class GemmaArgs(ModelArgs):
    layer_kinds: tuple[str, ...] = ()  # SLIDING or FULL, per layer
    sliding_window: int = 4096
    query_pre_attn_scalar: float = 256.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    activation: str = "gelu_pytorch_tanh"
    ropes: dict[str, RopeArgs] = field(default_factory=dict)  # per layer kind

    @classmethod
    def from_hf_config(cls, cfg: dict) -> GemmaArgs:
        arch = architecture(cfg)
        defaults = DEFAULTS[arch]
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("Gemma with use_bidirectional_attention (an encoder, e.g. "
                             "EmbeddingGemma) is not served: this engine decodes causally")
        activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if activation not in ACTIVATIONS:
            raise ValueError(f"hidden_activation {activation!r} is not supported for {arch}; "
                             f"supported: {', '.join(ACTIVATIONS)}")
        num_layers = cfg["num_hidden_layers"]
        pattern = cfg.get("sliding_window_pattern", defaults["sliding_window_pattern"])
        kinds = tuple(cfg.get("layer_types") or (
            SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)))
        window = cfg.get("sliding_window") or defaults["sliding_window"]
        base = ModelArgs.from_hf_config({**cfg, "head_dim": cfg.get("head_dim") or 256,
                                         "sliding_window": None})
        ropes = {kind: read_rope(rope) for kind, rope in rope_configs(cfg).items()}
        return cls(**{**base.__dict__, **dict(
            attention_bias=cfg.get("attention_bias", False),
            qk_norm="head" if arch == "Gemma3ForCausalLM" else None,
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            layer_windows=tuple(window if kind == SLIDING else None for kind in kinds),
            layer_kinds=kinds, sliding_window=window,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
            attn_softcap=cfg.get("attn_logit_softcapping", defaults["attn_logit_softcapping"])
            if arch == "Gemma2ForCausalLM" else None,  # Gemma 3 ignores it (module docstring)
            final_softcap=cfg.get("final_logit_softcapping", defaults["final_logit_softcapping"]),
            activation=activation, ropes=ropes, rope=ropes[FULL])})


def rope_configs(cfg: dict) -> dict[str, dict]:
    """The rope settings of each layer kind, each as the config.json keys read_rope reads.
    Gemma 3 written by transformers 5 nests them (`rope_parameters: {full_attention: {...},
    sliding_attention: {...}}`); on the Hub it has rope_theta + rope_scaling for full layers and
    rope_local_base_freq for sliding ones. Gemma 2 has one rope for both."""
    common = {"max_position_embeddings": cfg.get("max_position_embeddings", 8192)}
    if architecture(cfg) == "Gemma2ForCausalLM":
        rope = {k: cfg[k] for k in ("rope_parameters", "rope_theta", "rope_scaling") if k in cfg}
        return {SLIDING: common | rope, FULL: common | rope}
    nested = cfg.get("rope_parameters") or {}
    if FULL in nested or SLIDING in nested:
        return {kind: common | {"rope_parameters": nested.get(kind) or {}} for kind in (SLIDING, FULL)}
    return {FULL: common | {"rope_theta": cfg.get("rope_theta", 1_000_000.0),
                            "rope_scaling": cfg.get("rope_scaling")},
            SLIDING: common | {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}}


class LayerRopes(nn.Module):
    """One RotaryEmbedding per layer kind; `reserve` as RotaryEmbedding's (the model runner's)."""

    def __init__(self, head_dim: int, ropes: dict[str, RopeArgs]):
        super().__init__()
        self.ropes = {kind: RotaryEmbedding(head_dim, rope) for kind, rope in ropes.items()}

    def reserve(self, num_positions: int) -> None:
        for rope in self.ropes.values():
            rope.reserve(num_positions)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """kind -> (cos, sin), each [T, 1, head_dim]."""
        return {kind: rope(positions, dtype) for kind, rope in self.ropes.items()}


class GemmaDecoderLayer(Layer):
    def __init__(self, args: GemmaArgs, shard: Shard, index: int):
        super().__init__()
        self.kind = args.layer_kinds[index]
        hidden, eps = args.hidden_size, args.rms_norm_eps
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, GemmaRMSNorm(hidden, eps))
        self.self_attn = Attention(args, shard, scale=args.query_pre_attn_scalar ** -0.5,
                                   sliding_window=args.layer_windows[index],
                                   softcap=args.attn_softcap, norm=GemmaRMSNorm)
        self.mlp = MLP(args, shard, act=ACTIVATIONS[args.activation])

    def forward(self, ropes: dict, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; the norms after each block apply before the residual add
        x = x + self.post_attention_layernorm(self.self_attn(ropes[self.kind],
                                                             self.input_layernorm(x)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, args: GemmaArgs, shard: Shard):
        super().__init__()
        self.embed_tokens = VocabEmbedding(args.vocab_size, args.hidden_size, shard)
        self.layers = nn.ModuleList(GemmaDecoderLayer(args, shard, i)
                                    for i in range(args.num_layers))
        self.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = LayerRopes(args.head_dim, args.ropes)
        self.hidden_size = args.hidden_size
        self._scales: dict[torch.dtype, float] = {}

    def embed_scale(self, dtype: torch.dtype) -> float:
        """sqrt(hidden) rounded to `dtype`, as transformers multiplies by a tensor of the
        embeddings' dtype (in bfloat16 sqrt(2304) = 48.0 becomes 48.0, sqrt(3072) 55.5)."""
        if dtype not in self._scales:
            self._scales[dtype] = torch.tensor(self.hidden_size ** 0.5, dtype=dtype).item()
        return self._scales[dtype]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        x = x * self.embed_scale(x.dtype)
        ropes = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(ropes, x)
        return self.norm(x)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (text): Llama's checkpoint names, adapter
    targets and lm_head, Gemma's backbone and capped logits."""

    @classmethod
    def make_args(cls, hf_config: dict) -> GemmaArgs:
        return GemmaArgs.from_hf_config(hf_config)

    def make_model(self, shard: Shard) -> nn.Module:
        return GemmaModel(self.args, shard)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)  # [B, vocab] float32
        cap = self.args.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


ARCHITECTURES = {name: GemmaForCausalLM for name in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")}
