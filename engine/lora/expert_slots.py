"""The expert part of the adapter slot pool (engine/lora/pool.py): every MoE layer's
Experts.lora, one ExpertLoRABuffers per expert parameter (engine/layers/moe_lora.py), each
allocated when the first adapter with a LoRA on that parameter is registered. Per slot, in
elements (R = max_lora_rank, E experts, H hidden, I expert intermediate size):
    gate_up_proj   layers * E * R * (H + 2I)        down_proj   layers * E * R * (I + H)
The router's LoRA (target "gate") is an ordinary projection's: the slot pool's Linear `gate`.
"""

from __future__ import annotations

import torch

from loragw.adapters.format import LoraAdapter
from loragw.adapters.types import EXPERT_PARAMS, EXPERTS
from loragw.engine.layers.moe_lora import ExpertLoRABuffers
from loragw.engine.models.base import CausalLM


class ExpertSlots:
    def __init__(self, model: CausalLM, num_slots: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype):
        self.modules = list(model.expert_modules())  # (layer, Experts); none in a dense model
        self.num_slots, self.max_rank = num_slots, max_rank
        self.device, self.dtype = device, dtype
        self.held: set[int] = set()  # slots whose adapter has an expert LoRA

    @property
    def num_bytes(self) -> int:
        return sum(b.num_bytes for _, experts in self.modules
                   for b in (experts.lora or {}).values())

    def reserve(self, adapter: LoraAdapter) -> bool:
        """Allocate the buffers of every expert parameter `adapter` adapts that has none yet;
        whether any were allocated."""
        wanted = {target.split(".", 1)[1] for _, target in adapter.modules
                  if target.startswith(EXPERTS + ".")}
        allocated = False
        for _, experts in self.modules:
            for name in EXPERT_PARAMS:
                if name in wanted and name not in (experts.lora or {}):
                    experts.lora = (experts.lora or {}) | {name: self._pool(getattr(experts, name))}
                    allocated = True
        return allocated

    def _pool(self, weight: torch.Tensor) -> ExpertLoRABuffers:
        E, out_f, in_f = weight.shape  # [E, out, in]
        S, R = self.num_slots, self.max_rank
        return ExpertLoRABuffers(
            lora_a=torch.zeros(S, E, R, in_f, dtype=self.dtype, device=self.device),
            lora_b=torch.zeros(S, E, out_f, R, dtype=self.dtype, device=self.device),
            scales=torch.zeros(S, dtype=torch.float32, device=self.device),
            ranks=[0] * S)

    def fill(self, index: int, adapter: LoraAdapter) -> None:
        """Copy `adapter`'s expert LoRAs into slot `index` (cleared before)."""
        for layer, experts in self.modules:
            for name, buffers in (experts.lora or {}).items():
                weights = adapter.modules.get((layer, f"{EXPERTS}.{name}"))
                if weights is None:
                    continue
                r = weights.rank
                buffers.lora_a[index, :, :r].copy_(weights.lora_a, non_blocking=True)  # [E, r, in]
                buffers.lora_b[index, :, :, :r].copy_(weights.lora_b, non_blocking=True)
                buffers.scales[index] = weights.scaling
                buffers.ranks[index] = r
                self.held.add(index)

    def clear(self, index: int) -> None:
        self.held.discard(index)
        for _, experts in self.modules:
            for buffers in (experts.lora or {}).values():
                buffers.lora_a[index].zero_()
                buffers.lora_b[index].zero_()
                buffers.scales[index] = 0.0
                buffers.ranks[index] = 0

    def close(self) -> None:
        """Drop every expert LoRA buffer (the engine is closing)."""
        for _, experts in self.modules:
            experts.lora = None
        self.modules, self.held = [], set()
