"""Multi-LoRA kernels: segmented-gather shrink/expand (Triton) and their PyTorch reference.

    meta = make_lora_meta(token_slots, num_slots)      # once per step
    apply_lora(out, x, lora_a, lora_b, ranks, scales, slice_offsets, meta, backend)
    embedding_lora(out, ids, lora_a, lora_b, ranks, scales, meta, backend)  # embed_tokens

Triton is imported only when backend="triton" is first used.
"""

from kernels.meta import LoRAMeta, make_lora_meta
from kernels.ops import BACKENDS, apply_lora, embedding_lora, lora_expand, lora_shrink

__all__ = ["BACKENDS", "LoRAMeta", "apply_lora", "embedding_lora", "lora_expand", "lora_shrink",
           "make_lora_meta"]
