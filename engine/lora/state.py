"""The adapter manager's nouns (engine/lora/manager.py): a device Slot, a RegisteredAdapter with its
tiers, the LoRAStats counters the metrics read, and how a host copy is made."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from adapters.format import LoraAdapter


@dataclass(slots=True)
class Slot:
    adapter: str | None = None
    version: int = 0
    ref_count: int = 0  # running sequences that use this slot
    last_used: float = 0.0
    stale: bool = False  # adapter replaced or removed: finish current users, admit no one


@dataclass(slots=True)
class RegisteredAdapter:
    version: int
    path: str | None  # the disk tier; None for adapters handed over only in memory
    host: LoraAdapter | None  # the host tier; None once evicted from host memory
    num_bytes: int
    rank: int
    saved_modules: tuple[str, ...] = ()  # modules_to_save targets: needs a full-module slot
    pinned: bool = False
    last_used: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class LoRAStats:
    device_loads: int = 0  # host -> slot copies
    device_hits: int = 0  # admissions that found their adapter already in a slot
    device_evictions: int = 0
    host_loads: int = 0  # disk -> host parses
    host_evictions: int = 0


def host_copy(adapter: LoraAdapter, device: torch.device) -> LoraAdapter:
    """The host tier's copy of an adapter for an engine on `device`: in pinned memory on CUDA,
    so slot fills are async DMA copies. Saved modules stay pageable: page-locking [vocab,
    hidden] matrices per cached adapter would exhaust pinned memory, and they are copied only
    when their adapter enters a slot."""
    if device.type != "cuda":
        return adapter
    modules = {key: replace(m, lora_a=m.lora_a.pin_memory(), lora_b=m.lora_b.pin_memory())
               for key, m in adapter.modules.items()}
    return replace(adapter, modules=modules)
