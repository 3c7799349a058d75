"""Per-step batch metadata every layer reads during one forward pass.

The model runner builds a ForwardContext once per step and enters `forward_context(ctx)`;
attention reads the KV-cache addressing, LoRA-carrying modules read `lora` (a LoRAStep:
engine/forward/lora.py), and both read which kernels to run from `backends` (engine/forward/backends.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loragw.engine.forward.backends import Backends
from loragw.engine.forward.elementwise import TORCH, Elementwise

if TYPE_CHECKING:
    from loragw.engine.forward.lora import LoRAStep


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    # Decode rows: one query token each, batched with padded block tables. The model runner
    # fills the kernel's fields whenever there are decode rows, the torch path's only when
    # decode attention runs on torch (ForwardContext.backends.attention).
    num_decode_tokens: int  # decode tokens come first in the batch: rows [0, num_decode_tokens)
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] int32, padded with 0 (never read)
    decode_context_lens: torch.Tensor | None  # [D] int32: tokens in cache after this step
    decode_block_ids: torch.Tensor | None  # [D * max_blocks] int64: the block tables, flat
    decode_mask: torch.Tensor | None  # [D, 1, 1, L] bool: position < context length
    # Prefill rows (fresh prompts or chunks of them), one SDPA call per sequence.
    prefill_query_starts: list[int]  # start row of each prefill sequence in the batch
    prefill_query_lens: list[int]
    prefill_context_lens: list[int]  # tokens in cache after this step (prefix + chunk)
    prefill_block_tables: list[torch.Tensor]  # each [num_blocks] int64
    # The torch path on the CPU: decode rows by context length in cache-sized chunks
    # (engine/runner/inputs.py decode_chunks); None: one gather of every row at the longest width.
    decode_chunks: list[DecodeChunk] | None = None


@dataclass(slots=True)
class DecodeChunk:
    """Decode rows whose K/V are gathered and attended together, at their own longest width."""

    rows: torch.Tensor  # [n] int64: which decode rows
    block_ids: torch.Tensor  # [n * w] int64: their block tables, w blocks each
    mask: torch.Tensor  # [n, 1, 1, w * block_size] bool: position < context length


@dataclass(slots=True)
class ForwardContext:
    attn: AttentionMetadata
    lora: LoRAStep | None = None  # None when no row of the batch has an adapter
    backends: Backends = Backends()  # the model runner's, decided once at start-up


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext):
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    assert _current is not None, "layers run only inside forward_context(...)"
    return _current


def elementwise() -> Elementwise:
    """What runs this step's norms, rotary and SiLU-and-mul (Backends.fused, chosen once);
    torch's ops outside a step (a layer called on its own)."""
    return TORCH if _current is None else _current.backends.fused
