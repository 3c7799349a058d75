"""Full-module slots: the device copies of adapters' saved modules (PEFT's modules_to_save on
embed_tokens and lm_head; adapters.saved_modules), at most `capacity` adapters at once.

An adapter with saved modules holds one of these slots for as long as it holds its LoRA slot,
keyed by that LoRA slot's index. Unlike the LoRA pools nothing is preallocated: a slot's
[V, H] copies are allocated when its adapter is loaded and dropped when it leaves (the last
reference goes with them), since each is vocabulary-sized (~1 GB per module on an 8B model in
bf16). Saved copies PEFT ties to one tensor (ensure_weight_tying) stay one tensor here.

Per step, rows whose adapter replaces a module are grouped by adapter (FullModuleStep, built
by engine/forward/lora.py from the copies of the slots the step uses, which also holds the math):
    embed_tokens   y[t] = E_a[ids[t]]          for every new token t of adapter a
    lm_head        logits[b] = h[b] @ W_a.T    for every sampling row b of adapter a
"""

from __future__ import annotations

import torch


class FullModuleSlots:
    def __init__(self, capacity: int, device: torch.device, dtype: torch.dtype):
        self.capacity = capacity
        self.device, self.dtype = device, dtype
        self.held: dict[int, dict[str, torch.Tensor]] = {}  # LoRA slot -> target -> [V, H]

    @property
    def has_free(self) -> bool:
        return len(self.held) < self.capacity

    def holds(self, index: int) -> bool:
        return index in self.held

    @property
    def num_bytes(self) -> int:
        """Device bytes of the copies held now (a tied pair counted once)."""
        unique = {t.data_ptr(): t for copies in self.held.values() for t in copies.values()}
        return sum(t.numel() * t.element_size() for t in unique.values())

    def fill(self, index: int, saved: dict[str, torch.Tensor]) -> None:
        """Copy an adapter's saved modules (host, any float dtype) for LoRA slot `index`."""
        assert index not in self.held and self.has_free, "no free full-module slot to fill"
        copies: dict[int, torch.Tensor] = {}  # id(host tensor) -> its device copy
        for host in saved.values():
            if id(host) not in copies:
                copy = torch.empty(host.shape, dtype=self.dtype, device=self.device)
                copies[id(host)] = copy.copy_(host, non_blocking=True)  # [V, H]
        self.held[index] = {target: copies[id(host)] for target, host in saved.items()}

    def clear(self, index: int) -> None:
        self.held.pop(index, None)
