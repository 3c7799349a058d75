"""Device slot pool for LoRA adapters, and the per-step token -> slot map.

`max_loras` slots of up to `max_lora_rank` are preallocated per layer and projection. A slot
holds one version of one adapter; it is (re)filled only while no running sequence uses it,
so a step never sees a slot change under it. Adapters without a free slot wait in the queue
while requests for resident adapters keep flowing (see Scheduler).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from adapters.errors import AdapterError, AdapterNotFound
from adapters.format import BaseModelSpec, LoraAdapter, load_adapter
from engine.config import Config
from engine.layers.linear import LoRABuffers
from engine.models.llama import LlamaForCausalLM
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Slot:
    adapter: str | None = None
    version: int = 0
    ref_count: int = 0  # running sequences that use this slot
    last_used: float = 0.0
    stale: bool = False  # adapter replaced or removed: finish current users, admit no one


@dataclass(slots=True)
class RegisteredAdapter:
    adapter: LoraAdapter
    version: int
    num_bytes: int = field(default=0)


def resolve_lora_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError('lora_backend="triton" on CPU needs TRITON_INTERPRET=1 set before '
                         "start-up; use lora_backend=\"torch\" on CPU")
    return backend


class LoRAManager:
    def __init__(self, config: Config, model: LlamaForCausalLM, device: torch.device,
                 dtype: torch.dtype):
        self.num_slots = config.max_loras
        self.max_rank = config.max_lora_rank
        self.device, self.dtype = device, dtype
        self.backend = resolve_lora_backend(config.lora_backend, device)
        self.spec = BaseModelSpec.from_hf_config(config.hf_config, config.max_lora_rank)
        self.model = model
        self.adapters: dict[str, RegisteredAdapter] = {}
        self.slots = [Slot() for _ in range(self.num_slots)]
        self._versions = 0
        self._allocated = False
        self.loads = 0  # slot fills, for metrics and tests

    # ---- registry -------------------------------------------------------------------------
    def add(self, name: str, source: str | LoraAdapter) -> None:
        """Register (or replace) an adapter from a PEFT dir or an already-validated adapter."""
        adapter = load_adapter(source, self.spec) if isinstance(source, str) else source
        self._versions += 1
        if name in self.adapters:
            self._retire(name)
        self.adapters[name] = RegisteredAdapter(adapter, self._versions, adapter.num_bytes)
        self._allocate()

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterNotFound(f"adapter {name!r} is not registered")
        self._retire(name)
        del self.adapters[name]

    def check_known(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterNotFound(f"adapter {name!r} is not registered")

    def resident(self) -> list[str]:
        return [s.adapter for s in self.slots if s.adapter is not None and not s.stale]

    @property
    def slots_in_use(self) -> int:
        return sum(1 for s in self.slots if s.ref_count > 0)

    def _retire(self, name: str) -> None:
        for index, slot in enumerate(self.slots):
            if slot.adapter == name:
                slot.stale = True
                if slot.ref_count == 0:
                    self._clear(index)

    # ---- slots (SlotPolicy for the scheduler) ---------------------------------------------
    def acquire(self, seq: Sequence) -> bool:
        if seq.adapter is None:
            return True
        registered = self.adapters.get(seq.adapter)
        if registered is None:
            return False
        index = self._find(seq.adapter, registered.version)
        if index is None:
            index = self._victim()
            if index is None:
                return False
            self._fill(index, seq.adapter, registered)
        slot = self.slots[index]
        slot.ref_count += 1
        slot.last_used = time.monotonic()
        seq.lora_slot = index
        return True

    def release(self, seq: Sequence) -> None:
        if seq.adapter is None:
            return
        assert seq.lora_slot >= 0, f"release of {seq.adapter!r} without a held slot"
        slot = self.slots[seq.lora_slot]
        assert slot.ref_count > 0 and slot.adapter == seq.adapter
        slot.ref_count -= 1
        if slot.stale and slot.ref_count == 0:
            self._clear(seq.lora_slot)
        seq.lora_slot = -1

    def _find(self, name: str, version: int) -> int | None:
        for index, slot in enumerate(self.slots):
            if slot.adapter == name and slot.version == version and not slot.stale:
                return index
        return None

    def _victim(self) -> int | None:
        """A free slot, else the least recently used slot nobody is running on."""
        free = [i for i, s in enumerate(self.slots) if s.adapter is None]
        if free:
            return free[0]
        idle = [i for i, s in enumerate(self.slots) if s.ref_count == 0]
        return min(idle, key=lambda i: self.slots[i].last_used) if idle else None

    # ---- device buffers -------------------------------------------------------------------
    def _layers(self):
        for index, layer in enumerate(self.model.model.layers):
            modules = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
                       "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj}
            yield index, modules

    def _allocate(self) -> None:
        """Preallocate every projection's slot pool, once, on the first adapter."""
        if self._allocated:
            return
        S, R = self.num_slots, self.max_rank
        for _, modules in self._layers():
            for linear in modules.values():
                n = len(linear.slice_names)
                linear.lora = LoRABuffers(
                    lora_a=torch.zeros(n, S, R, linear.in_features, dtype=self.dtype,
                                       device=self.device),  # [n_slices, S, R, H]
                    lora_b=torch.zeros(S, linear.out_features, R, dtype=self.dtype,
                                       device=self.device),  # [S, O_total, R]
                    ranks=torch.zeros(n, S, dtype=torch.int32, device=self.device),
                    scales=torch.zeros(n, S, dtype=torch.float32, device=self.device))
        self._allocated = True

    def _fill(self, index: int, name: str, registered: RegisteredAdapter) -> None:
        self._clear(index)
        modules = registered.adapter.modules
        for layer_index, layers in self._layers():
            for linear in layers.values():
                lora = linear.lora
                for i, target in enumerate(linear.slice_names):
                    weights = modules.get((layer_index, target))
                    if weights is None:
                        continue  # absent target: rank 0, contributes nothing
                    rank = weights.lora_a.shape[0]
                    rows = linear.slice_rows(target)
                    lora.lora_a[i, index, :rank].copy_(weights.lora_a, non_blocking=True)
                    lora.lora_b[index, rows, :rank].copy_(weights.lora_b, non_blocking=True)
                    lora.ranks[i, index] = rank
                    lora.scales[i, index] = weights.scaling
        self.slots[index] = Slot(adapter=name, version=registered.version,
                                 last_used=time.monotonic())
        self.loads += 1
        logger.info("adapter %s loaded into slot %d", name, index)

    def _clear(self, index: int) -> None:
        assert self.slots[index].ref_count == 0, "clearing a slot that a sequence still uses"
        if self._allocated:
            for _, layers in self._layers():
                for linear in layers.values():
                    linear.lora.lora_a[:, index].zero_()
                    linear.lora.lora_b[index].zero_()
                    linear.lora.ranks[:, index] = 0
                    linear.lora.scales[:, index] = 0.0
        self.slots[index] = Slot()

    # ---- per step -------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch):
        """The token -> slot map of this step, or None when no token has an adapter."""
        if not any(seq.adapter for seq in batch.seqs):
            return None
        from kernels import make_lora_meta

        token_slots: list[int] = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            assert seq.adapter is None or seq.lora_slot >= 0, "running adapter without a slot"
            token_slots.extend([seq.lora_slot if seq.adapter else -1] * num_new)
        slots = torch.tensor(token_slots, dtype=torch.int32, device=self.device)  # [T]
        return make_lora_meta(slots, self.num_slots)


__all__ = ["LoRAManager", "AdapterError", "resolve_lora_backend"]
