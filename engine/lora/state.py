"""The adapter manager's nouns (engine/lora/manager.py): a device Slot, a RegisteredAdapter with its
tiers, the LoRAStats counters the metrics read, and how a host copy is made."""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from loragw.adapters.format import LoraAdapter


@dataclass(slots=True)
class Slot:
    adapter: str | None = None
    version: int = 0
    ref_count: int = 0  # running sequences that use this slot
    last_used: float = 0.0
    stale: bool = False  # adapter replaced or removed: finish current users, admit no one


@dataclass(slots=True)
class RegisteredAdapter:
    version: int  # the engine's own count of registrations: prefix-cache keys, slot identity
    path: str | None  # the disk tier; None for adapters handed over only in memory
    host: LoraAdapter | None  # the host tier; None once evicted from host memory
    num_bytes: int
    rank: int
    saved_modules: tuple[str, ...] = ()  # modules_to_save targets: needs a full-module slot
    pinned: bool = False
    last_used: float = field(default_factory=time.monotonic)
    catalog_version: int | None = None  # the fleet's number for it, what logs name; None offline
    sha256: str | None = None  # its weights' digest: a re-read from disk is not hashed again

    @property
    def shown_version(self) -> str:
        """The catalog's version as a log line shows it, ' (v3)'; '' where none was given."""
        return "" if self.catalog_version is None else f" (v{self.catalog_version})"


# Buckets of the seconds a load into a tier takes (the gateway's load-seconds histogram too).
LOAD_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                        30.0, 60.0)


@dataclass(slots=True)
class LoadTimes:
    """Seconds of the loads into one tier: a count per LOAD_SECONDS_BUCKETS bucket (+Inf last,
    not cumulative) and their sum. Bucketed, so it stays one small fixed size however long the
    engine runs."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LOAD_SECONDS_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LOAD_SECONDS_BUCKETS, seconds)] += 1
        self.total += seconds

    @contextlib.contextmanager
    def timed(self, extra_seconds: float = 0.0) -> Iterator[None]:
        """Observe the seconds the block takes, plus `extra_seconds` spent on it before."""
        started = time.perf_counter()
        yield
        self.observe(time.perf_counter() - started + extra_seconds)

    def copy(self) -> LoadTimes:
        return LoadTimes(list(self.counts), self.total)


@dataclass(slots=True)
class LoRAStats:
    device_loads: int = 0  # host -> slot copies
    device_hits: int = 0  # admissions that found their adapter already in a slot
    device_evictions: int = 0
    host_loads: int = 0  # disk -> host parses
    host_evictions: int = 0
    device_load_times: LoadTimes = field(default_factory=LoadTimes)
    host_load_times: LoadTimes = field(default_factory=LoadTimes)  # re-reads after an eviction


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
