"""Adapters inside the engine: host copies (an LRU bounded by `max_cpu_loras`) and the device
slots (`max_loras` slots of up to `max_lora_rank`; their buffers: engine/lora/pool.py). An
adapter with saved modules (modules_to_save) needs one of `max_full_module_slots` full-module
slots too: it gets a LoRA slot only while one is free or held by an idle adapter it evicts.

A slot holds one version of one adapter and is refilled only while no running sequence uses
it, so a step never sees a slot change under it. An adapter whose host copy was evicted is
re-read from its directory (the disk tier) when next needed, off the step loop when a request
needs it (engine/lora/reads.py). Pinned adapters are never evicted.
"""

from __future__ import annotations

import logging
import time

import torch

from loragw.adapters.errors import AdapterError, AdapterNotFound
from loragw.adapters.format import LoraAdapter, read_adapter
from loragw.adapters.saved_modules import FLAG, full_modules_off
from loragw.engine.config import Config
from loragw.engine.forward.lora import LoRARows
from loragw.engine.lora.aging import slot_to_drain
from loragw.engine.lora.pool import SlotPool, SlotSink
from loragw.engine.lora.reads import HostReads
from loragw.engine.lora.state import LoRAStats, RegisteredAdapter, Slot, host_copy
from loragw.engine.lora.versions import StartedVersions
from loragw.engine.models.llama import LlamaForCausalLM
from loragw.engine.request.sequence import Sequence
from loragw.engine.sched.batch import ScheduledBatch

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, config: Config, model: LlamaForCausalLM, device: torch.device,
                 dtype: torch.dtype, replicas: SlotSink | None = None):
        self.num_slots = config.max_loras
        self.max_rank = config.max_lora_rank
        self.max_host = config.max_host_loras
        self.starvation_steps = config.lora_starvation_steps
        self.device, self.dtype = device, dtype
        self.spec = config.adapter_spec()
        self.model = model
        self.adapters: dict[str, RegisteredAdapter] = {}
        self.slots = [Slot() for _ in range(self.num_slots)]
        self.pool = SlotPool(model, self.num_slots, self.max_rank, device, dtype,
                             config.max_full_module_slots, replicas)
        self.stats = LoRAStats()
        self.reads = HostReads(self.spec)
        self.started = StartedVersions()  # each sequence keeps the version it started on
        self._versions = 0

    # ---- registry and host tier -----------------------------------------------------------
    def add(self, name: str, adapter: LoraAdapter, path: str | None = None,
            busy: set[str] = frozenset(), catalog_version: int | None = None) -> int:
        """Register or replace `name` with `adapter`, validated already (`path`: its disk copy,
        re-read after a host eviction); its engine version (`catalog_version`: the fleet's, what
        logs name). `busy`: adapters with queued requests, kept in host memory if possible."""
        if adapter.saved_modules and not self.pool.full.capacity:
            raise full_modules_off(tuple(adapter.saved_modules))
        adapter = host_copy(adapter, self.device)
        self.pool.reserve(adapter)  # before anything changes: a failed allocation changes nothing
        self._versions += 1
        previous = self.adapters.get(name)
        if previous is not None:
            self.started.replaced(name, previous)
            self._retire(name)
        self.adapters[name] = RegisteredAdapter(
            self._versions, path, adapter, adapter.num_bytes, adapter.max_rank,
            tuple(adapter.saved_modules), pinned=previous.pinned if previous else False,
            catalog_version=catalog_version, sha256=adapter.sha256)
        self._trim_host(keep={name} | set(busy))
        return self._versions

    def remove(self, name: str) -> None:
        self.check_known(name)
        self._retire(name)
        del self.adapters[name]

    def evict(self, name: str) -> bool:
        """Drop an adapter's device slot (if idle) and host copy; it stays on disk. Returns
        whether it is now off the device (False while a running sequence still uses it)."""
        entry = self._get(name)
        if entry.pinned:
            raise AdapterError(f"adapter {name!r} is pinned; unpin it before evicting", )
        on_device = False
        for index, slot in enumerate(self.slots):
            if slot.adapter == name and slot.ref_count:
                on_device = True
            elif slot.adapter == name:
                self._clear(index)
                self.stats.device_evictions += 1
        if entry.path is not None and not on_device and entry.host is not None:
            entry.host = None
            self.stats.host_evictions += 1
        return not on_device

    def to_device(self, name: str) -> str:
        """Bring an adapter into a device slot ahead of traffic; returns its residency. When
        every slot is busy it stays in host memory and loads on its first request."""
        entry = self._get(name)
        self._ensure_host(name, entry)
        if self._find(name, entry.version) is None:
            victims = self._victims(bool(entry.saved_modules))
            if not victims:
                return "host"
            self._fill(victims[0], name, entry)
        return "device"

    def pin(self, name: str, pinned: bool = True) -> None:
        entry = self._get(name)
        entry.pinned = pinned
        # At least one slot must stay evictable, or other adapters' requests could never run.
        pinned_entries = [e for e in self.adapters.values() if e.pinned]
        if pinned and len(pinned_entries) >= self.num_slots:
            entry.pinned = False
            raise AdapterError(f"cannot pin {name!r}: pinning every one of the --max-loras "
                               f"({self.num_slots}) slots would starve other adapters; raise --max-loras")
        if (pinned and entry.saved_modules
                and sum(bool(e.saved_modules) for e in pinned_entries) >= self.pool.full.capacity):
            entry.pinned = False
            raise AdapterError(f"cannot pin {name!r}: pinning every one of the {FLAG} "
                               f"({self.pool.full.capacity}) slots would starve other adapters with "
                               f"saved modules; raise {FLAG}")

    def check_known(self, name: str) -> None:
        self._get(name)

    def residency(self, name: str) -> str:
        """"device" (in a slot), "host" (parsed in memory) or "disk"."""
        entry = self._get(name)
        if any(s.adapter == name and s.version == entry.version and not s.stale
               for s in self.slots):
            return "device"
        return "host" if entry.host is not None else "disk"

    def resident(self) -> list[str]:
        return [s.adapter for s in self.slots if s.adapter is not None and not s.stale]

    @property
    def slots_in_use(self) -> int:
        return sum(1 for s in self.slots if s.ref_count > 0)

    @property
    def free_slots(self) -> int:
        """Slots holding no adapter (a stale slot still drains, so it is not free)."""
        return sum(s.adapter is None for s in self.slots)

    @property
    def host_bytes(self) -> int:
        return sum(e.num_bytes for e in self.adapters.values() if e.host is not None)

    def _get(self, name: str) -> RegisteredAdapter:
        entry = self.adapters.get(name)
        if entry is None:
            raise AdapterNotFound(f"adapter {name!r} is not registered")
        return entry

    def _trim_host(self, keep: set[str]) -> None:
        in_slots = {s.adapter for s in self.slots if s.ref_count}
        hosted = [(e.last_used, n) for n, e in self.adapters.items() if e.host is not None]
        excess = len(hosted) - self.max_host
        for _, name in sorted(hosted):
            if excess <= 0:
                break
            entry = self.adapters[name]
            if name in keep or name in in_slots or entry.pinned or entry.path is None:
                continue
            entry.host = None
            self.stats.host_evictions += 1
            excess -= 1

    def _ensure_host(self, name: str, entry: RegisteredAdapter, adapter: LoraAdapter | None = None,
                     read_seconds: float = 0.0) -> LoraAdapter:
        """The host copy, re-read from disk if evicted (or `adapter`, read in read_seconds)."""
        if entry.host is None:
            with self.stats.host_load_times.timed(read_seconds):
                adapter = adapter or read_adapter(entry.path, self.spec, entry.sha256)
                entry.host = host_copy(adapter, self.device)
            self.stats.host_loads += 1
            self._trim_host(keep={name})
        entry.last_used = time.monotonic()
        return entry.host

    def _retire(self, name: str) -> None:
        self.reads.forget(name)
        for index, slot in enumerate(self.slots):
            if slot.adapter == name:
                slot.stale = True
                if slot.ref_count == 0:
                    self._clear(index)

    # ---- device slots (the scheduler's SlotPolicy) ----------------------------------------
    def acquire(self, seq: Sequence) -> bool:
        if seq.adapter is None:
            return True
        entry = self.started.entry_for(seq, self.adapters.get(seq.adapter))
        if entry is None:
            return False
        index = self._find(seq.adapter, entry.version)
        if index is None:
            victims = self._victims(bool(entry.saved_modules))
            if not victims:
                return False
            if entry.host is None:  # the disk tier: the sequence waits for the read, which
                # starts only while a slot could take it, and no more at once than such slots
                read = (self.reads.take(seq.adapter, entry)
                        if self.reads.may_start(seq.adapter, len(victims)) else None)
                if read is None:
                    return False
                self._ensure_host(seq.adapter, entry, *read)
            index, started = victims[0], time.monotonic()
            self._fill(index, seq.adapter, entry)
            seq.device_load = (started, time.monotonic())  # its trace's host -> device span
        else:
            self.stats.device_hits += 1
        slot = self.slots[index]
        slot.ref_count += 1
        slot.last_used = entry.last_used = time.monotonic()
        seq.lora_slot = index
        self.started.start(seq, entry)
        return True

    def version(self, adapter: str) -> int:
        """The version acquire() gives a new sequence (0: unknown, refused anyway): its
        prefix-cache key, so old versions' blocks never match."""
        entry = self.adapters.get(adapter)
        return entry.version if entry is not None else 0

    def finished(self, seq: Sequence) -> None:
        self.started.finished(seq)

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

    def drain_for(self, waited: int, adapter: str) -> str | None:
        """Aging (engine/lora/aging.py): the adapter whose slot should drain for `adapter`."""
        return slot_to_drain(self.slots, self.adapters, self.pool.full, self.starvation_steps,
                             waited, adapter)

    def _find(self, name: str, version: int) -> int | None:
        for index, slot in enumerate(self.slots):
            if slot.adapter == name and slot.version == version and not slot.stale:
                return index
        return None

    def _victims(self, needs_full: bool = False) -> list[int]:
        """The slots an adapter may take, best first: free slots, then idle slots of unpinned
        adapters, least recently used first. With `needs_full` and no full-module slot free,
        only idle slots that hold one will do (clearing one frees both)."""
        full_free = not needs_full or self.pool.full.has_free
        free = [i for i, s in enumerate(self.slots) if s.adapter is None and full_free]
        idle = [i for i, s in enumerate(self.slots) if s.adapter is not None and s.ref_count == 0
                and not self.adapters[s.adapter].pinned and (full_free or self.pool.full.holds(i))]
        return free + sorted(idle, key=lambda i: self.slots[i].last_used)

    # ---- device buffers (engine/lora/pool.py) ---------------------------------------------
    @property
    def device_bytes(self) -> dict[str, int]:
        """Bytes of the device slot pools, per kind: projections, embed_tokens, lm_head, and
        full_modules (the saved modules of the resident adapters that have them)."""
        return self.pool.num_bytes

    def _fill(self, index: int, name: str, entry: RegisteredAdapter) -> None:
        adapter = self._ensure_host(name, entry)
        self.stats.device_evictions += self.slots[index].adapter is not None
        self.slots[index] = Slot()  # emptied first: a fill that fails leaves no adapter named
        with self.stats.device_load_times.timed():  # the copies' issue (on CUDA they run async)
            self.pool.fill(index, adapter)  # over the old adapter's buffers
        self.slots[index] = Slot(adapter=name, version=entry.version, last_used=time.monotonic())
        self.stats.device_loads += 1
        logger.info("adapter %s%s loaded into slot %d", name, entry.shown_version, index)

    def _clear(self, index: int) -> None:
        assert self.slots[index].ref_count == 0, "clearing a slot that a sequence still uses"
        self.pool.clear(index)
        self.slots[index] = Slot()

    # ---- per step -------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> LoRARows | None:
        """This step's row -> slot maps, or None when no row has an adapter (SlotPool.rows)."""
        return self.pool.rows(batch)

    def close(self) -> None:
        """Drop every host copy and device slot (the engine is closing)."""
        self.reads.close()
        self.adapters.clear()
        self.slots = [Slot() for _ in range(self.num_slots)]
        self.pool.close()
        self.model = None
