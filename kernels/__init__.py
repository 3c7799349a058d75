"""Multi-LoRA kernels: segmented-gather shrink/expand (Triton) and their PyTorch reference.

    meta = make_lora_meta(token_slots, num_slots)      # once per step
    kernels = lora_kernels(backend)                     # once per engine
    kernels.apply(out, x, lora_a, lora_b, ranks, scales, slice_offsets, meta)
    kernels.embedding(out, ids, lora_a, lora_b, ranks, scales, meta)  # embed_tokens
(`apply_lora(..., backend=name)` and the others take the backend by name per call.)

Triton is imported only when backend="triton" is first used.
"""

from loragw.kernels.meta import LoRAMeta, make_lora_meta
from loragw.kernels.ops import (
    BACKENDS,
    LoRAKernels,
    apply_lora,
    embedding_lora,
    lora_expand,
    lora_kernels,
    lora_shrink,
)

__all__ = ["BACKENDS", "LoRAKernels", "LoRAMeta", "apply_lora", "embedding_lora", "lora_expand",
           "lora_kernels", "lora_shrink", "make_lora_meta"]
