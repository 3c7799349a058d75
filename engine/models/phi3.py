"""Phi-3 (Phi-3-mini / small-context and 128k, Phi-3.5-mini, Phi-4-mini) as the Llama model with
fused checkpoint projections.

The checkpoint stores `self_attn.qkv_proj.weight` [q + 2 kv, H] and `mlp.gate_up_proj.weight`
[2 I, H] as one tensor each; the engine's Linears already hold those slices (q|k|v, gate|up),
so the loader splits each fused tensor by slice rows (`fused_projections`, from
`fused_modules`) and, under tensor parallelism, every Linear keeps its rank's part of each
slice. Adapters name the fused modules too (qkv_proj, gate_up_proj: the BaseModelSpec's
`fused`, from the same layout); the slot pool gives each slice the adapter's A and its rows of B.

Rope: default or longrope, over partial_rotary_factor of each head (engine/layers/rotary.py).
Phi-3 configs carry `sliding_window` (2047 for Phi-3-mini-4k): every layer slides, as in
transformers (engine/models/args.py layer_windows; the attention layer applies it).
"""

from __future__ import annotations

from dataclasses import dataclass

from loragw.engine.models.args import ModelArgs
from loragw.engine.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class Phi3Args(ModelArgs):
    @classmethod
    def from_hf_config(cls, cfg: dict) -> Phi3Args:
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Phi-3 config.json has hidden_act {act!r}; only 'silu' is served")
        # Phi3Config's default when config.json has none; it overrides rope_scaling's own
        return super().from_hf_config({"original_max_position_embeddings": 4096, **cfg})


class Phi3ForCausalLM(LlamaForCausalLM):
    merged_projections = {}  # no separately named q/k/v, gate/up tensors
    # checkpoint module -> the slices its rows stack, in order (their rows: the args' shapes)
    fused_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                     "gate_up_proj": ("gate_proj", "up_proj")}

    @classmethod
    def make_args(cls, hf_config: dict) -> Phi3Args:
        return Phi3Args.from_hf_config(hf_config)


# config.json "architectures" -> the class that serves it (engine/models/__init__.py)
ARCHITECTURES = {"Phi3ForCausalLM": Phi3ForCausalLM}
