"""The shapes the engine ships for, as data: each model's LoRA-wrapped projections (input
features and output slices, as one GPU sees them) and its decode-attention heads, plus a grid
of head shapes beyond them. kernels/compile_targets.py enumerates the kernel binaries over these.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Projection:
    name: str
    hidden: int                # input features H
    widths: tuple[int, ...]    # output slices (n_slices = len)


@dataclass(frozen=True)
class ModelShape:
    name: str
    projections: tuple[Projection, ...]
    attention: tuple[int, int, int]   # (n_heads, n_kv_heads, head_dim) as one GPU sees them


def _llama_like(name: str, hidden: int, q: int, kv: int, inter: int, row_in: int, vocab: int,
                heads: tuple[int, int, int]) -> ModelShape:
    """embed_tokens' LoRA is an expand of width `hidden` over one slice: o_proj's variant."""
    return ModelShape(name, (
        Projection("qkv_proj", hidden, (q, kv, kv)),
        Projection("o_proj", row_in, (hidden,)),
        Projection("gate_up_proj", hidden, (inter, inter)),
        Projection("down_proj", inter, (hidden,)),
        Projection("lm_head", hidden, (vocab,)),
    ), heads)


SHIPPED_MODELS = (
    _llama_like("Llama-3-8B", 4096, 4096, 1024, 14336, 4096, 128256, (32, 8, 128)),
    _llama_like("Qwen2.5-7B", 3584, 3584, 512, 18944, 3584, 152064, (28, 4, 128)),
    # tp=8 shard: column-parallel outputs and row-parallel inputs divided by 8.
    _llama_like("Llama-3-70B tp8", 8192, 1024, 128, 3584, 1024, 16032, (8, 1, 128)),
    _llama_like("Qwen2.5-1.5B (helm default)", 1536, 1536, 256, 8960, 1536, 151936, (12, 2, 128)),
)
# Decode attention beyond the shipped models: (n_heads, n_kv_heads, head_dim), GQA 1..8.
ATTENTION_GRID = tuple((8 * g, 8, d) for d in (64, 128) for g in range(1, 9))
