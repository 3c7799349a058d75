"""What a model is, read from config.json once: `ModelArgs` (the Llama family's, which every
family extends: gemma.py's GemmaArgs, moe.py's MoeArgs). The model is built from it and the
adapters' BaseModelSpec is derived from it (engine/models/base.py), so the two never disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loragw.engine.layers.rotary import RopeArgs

ROPE_TYPE_ALIASES = {"su": "longrope"}  # Phi-3's first configs

def architecture(cfg: dict) -> str:
    """The class config.json names (architectures[0]), else its model_type."""
    archs = cfg.get("architectures") or []
    return archs[0] if archs else str(cfg.get("model_type", "?"))


def positive(cfg: dict, key: str) -> int:
    """cfg[key], which must be a positive int."""
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"base model config.json: {key} missing or not a positive int (got "
                         f"{value!r}); is this a Hugging Face checkpoint of a served architecture?")
    return value


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
    # the q/k RMSNorm: "head" per head over head_dim, before rope (Qwen3, Gemma 3); "whole"
    # over all of q and all of k, before the head split (OLMoE); None: no q/k norm
    qk_norm: str | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_windows: tuple[int | None, ...] = ()  # per layer: its sliding window, None = full
    clip_qkv: float | None = None  # q, k and v clamped to [-clip, clip] (OLMoE)
    rope: RopeArgs = RopeArgs()
    architecture: str = ""  # the class config.json names (engine/models/__init__.py serves it)
    checkpoint_dtype: str | None = None  # the weights' dtype as saved ("bfloat16"), if stated
    name_or_path: str | None = None  # the name the checkpoint was saved under (_name_or_path)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArgs:
        arch = architecture(cfg)
        hidden, heads = positive(cfg, "hidden_size"), positive(cfg, "num_attention_heads")
        if not cfg.get("head_dim") and hidden % heads:
            raise ValueError(f"base model config.json: hidden_size {hidden} % heads {heads} != 0 "
                             "and no head_dim is given")
        return cls(
            vocab_size=positive(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=positive(cfg, "intermediate_size"),
            num_layers=positive(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm="head" if arch == "Qwen3ForCausalLM" else None,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            layer_windows=layer_windows(cfg, arch),
            rope=read_rope(cfg),
            architecture=arch,
            checkpoint_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            name_or_path=cfg["_name_or_path"] if isinstance(cfg.get("_name_or_path"), str)
            else None,
        )

    @property
    def context_window(self) -> int:
        """The longest sequence served by default: max_position_embeddings, or less where the
        rope schedule is exact only up to a shorter length (longrope)."""
        exact = self.rope.exact_context
        if exact is not None and exact < self.max_position_embeddings:
            return exact
        return self.max_position_embeddings

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """Adapter target -> (out, in) of a decoder layer's projections, the whole model's (not
        a rank's part): q/k/v/o_proj and the dense MLP's gate/up/down_proj."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        hidden, inter = self.hidden_size, self.intermediate_size
        return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
                "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
                "down_proj": (hidden, inter)}

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer: none in a dense model (MoeArgs)."""
        return 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is experts: none in a dense model (MoeArgs)."""
        return ()


def layer_windows(cfg: dict, arch: str) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers decides it: `layer_types` when config.json
    names them; else Mistral and Phi-3 slide every layer when `sliding_window` is set, Qwen2/3
    the layers from `max_window_layers` on when `use_sliding_window` is true."""
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


def read_rope(cfg: dict) -> RopeArgs:
    """The rope of a config.json, old style (`rope_theta` + `rope_scaling`) or new
    (`rope_parameters`); the keys of either override the top-level ones."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    max_len = cfg.get("max_position_embeddings", 4096)
    original = params.get("original_max_position_embeddings")
    attention = 1.0
    if rope_type == "longrope":  # Phi-3 keeps the pretraining length outside rope_scaling
        original = cfg.get("original_max_position_embeddings", original or max_len)
        factor = params.get("factor") or max_len / original
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeArgs(
        rope_type=rope_type,
        theta=params.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        partial_rotary_factor=params.get("partial_rotary_factor",
                                         cfg.get("partial_rotary_factor", 1.0)),
        max_position_embeddings=max_len,
        factor=params.get("factor"),
        low_freq_factor=params.get("low_freq_factor"),
        high_freq_factor=params.get("high_freq_factor"),
        original_max_position_embeddings=original,
        short_factor=tuple(params.get("short_factor") or ()),
        attention_factor=attention,
    )
