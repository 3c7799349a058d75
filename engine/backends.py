"""Which kernels a step runs on, decided once per engine (by the model runner, at start-up)
and read by every layer from the forward context.

    lora       kernels.apply_lora / embedding_lora: "torch" (kernels/reference.py, the CPU
               production path) or "triton" (kernels/lora_triton.py).
    attention  decode rows of engine/layers/attention.py: "torch" (gather whole blocks, one
               batched SDPA) or "triton" (kernels/paged_attention.py reads K/V in place).

`auto` is triton on CUDA and torch elsewhere, except that auto decode attention on CUDA takes
the Triton kernel only after it matched the float64 reference on a small random cache of the
model's shapes (kernels.paged_attention.self_check); otherwise it warns and keeps torch, so a
kernel that fails to compile or is wrong on some GPU never serves. A forced backend is used as
it is, except that the Triton kernel has no sliding window or score soft-capping: a model
with either (`kernel_gaps`) decodes on torch, with the reason logged (auto) or raised (forced).
Triton on CPU runs under its interpreter only: TRITON_INTERPRET=1 must be set before
the kernels are first imported (tests do this).
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Backends:
    lora: str = "torch"
    attention: str = "torch"


@dataclass(frozen=True, slots=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int


def resolve_lora_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError('lora_backend="triton" on CPU needs TRITON_INTERPRET=1 set before '
                         'start-up; use lora_backend="torch" on CPU')
    return name


def kernel_gaps(layers) -> str | None:
    """Why kernels/paged_attention.py cannot decode these PagedAttention layers, or None."""
    gaps = [what for what, attr in (("sliding-window", "sliding_window"),
                                    ("soft-capped", "softcap"))
            if any(getattr(layer, attr) is not None for layer in layers)]
    return f"the model has {' and '.join(gaps)} attention layers" if gaps else None


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype,
                              shape: AttentionShape, gaps: str | None = None) -> str:
    if name == "triton" and gaps is not None:
        raise ValueError(f'attention_backend="triton" cannot serve this model: {gaps}, which '
                         'the Triton decode kernel does not take; use attention_backend="auto" '
                         'or "torch"')
    if name != "auto":
        return name
    if device.type != "cuda":
        return "torch"
    if gaps is not None:
        logger.info("decode attention on torch, not the Triton kernel: %s", gaps)
        return "torch"
    paged = importlib.import_module("kernels.paged_attention")  # triton only on CUDA
    problem = paged.self_check(device, dtype, shape.num_heads, shape.num_kv_heads,
                               shape.head_dim)
    if problem is not None:
        logger.warning("Triton paged decode attention is off, torch serves decode: %s (force "
                       "it with attention_backend=triton)", problem)
        return "torch"
    return "triton"


def resolve_backends(lora: str, attention: str, device: torch.device, dtype: torch.dtype,
                     shape: AttentionShape, gaps: str | None = None) -> Backends:
    """The engine's Backends from Config.lora_backend and Config.attention_backend; `gaps`:
    kernel_gaps of the model's attention layers."""
    return Backends(resolve_lora_backend(lora, device),
                    resolve_attention_backend(attention, device, dtype, shape, gaps))
