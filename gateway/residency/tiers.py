"""One replica's adapters across its three tiers, and the moves between them.

Disk: the store under --adapter-dir (versioned, known again after a restart, parsed lazily on
first use). Host and device: inside the engine (LRU host copies and device slots, see
engine/lora.py). Every adapter is validated against the base model off the engine thread
before anything is stored; the engine thread only copies tensors.

The moves take no locks: AdapterManager (gateway/residency/manager.py) holds the adapter
id's lock around each one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from adapters.errors import AdapterNotFound
from adapters.format import load_adapter, load_adapter_bytes
from adapters.sources import parse_source, resolve_source
from adapters.store import AdapterStore
from adapters.store_meta import StoredAdapter, StoredMeta
from engine.async_engine import AsyncEngine
from gateway.errors import APIError
from gateway.metrics import Metrics


@dataclass(slots=True)
class AdapterRecord:
    """A registered adapter: its stored copy, and whether the engine knows it yet."""

    stored: StoredAdapter
    in_engine: bool = False  # False: on disk only, parsed and registered on first use
    pinned: bool = False

    @property
    def name(self) -> str:
        return self.stored.adapter_id

    @property
    def source(self) -> str:
        return self.stored.source

    @property
    def created(self) -> int:
        return int(self.stored.created_at)


class AdapterTiers:
    def __init__(self, adapter_dir: str, engine: AsyncEngine, metrics: Metrics, *,
                 hub_endpoint: str | None, hub_cache_dir: str | None):
        self.adapter_dir, self.engine, self.metrics = adapter_dir, engine, metrics
        self.llm = engine.engine  # its methods run on the engine thread, through engine.call
        self.hub_endpoint, self.hub_cache_dir = hub_endpoint, hub_cache_dir
        self.store: AdapterStore | None = None  # opened by open()
        self.records: dict[str, AdapterRecord] = {}
        self.loading: set[str] = set()  # ids being parsed into host memory right now

    async def open(self) -> list[StoredAdapter]:
        """Open the store; its adapters, for the caller to register."""
        self.store = await asyncio.to_thread(AdapterStore, self.adapter_dir)
        return await asyncio.to_thread(self.store.list)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def record(self, adapter_id: str) -> AdapterRecord:
        record = self.records.get(adapter_id)
        if record is None:
            raise AdapterNotFound(f"adapter {adapter_id!r} is not registered; GET "
                                  "/admin/adapters lists the registered ones")
        return record

    # ---- onto disk (and into the engine) -----------------------------------------------------
    async def fetch(self, adapter_id: str, source: str, replace: bool) -> StoredAdapter:
        """A Hub or local source, fetched, validated and stored; see `put`."""
        parsed = parse_source(source)
        started = time.perf_counter()
        files = await asyncio.to_thread(resolve_source, parsed, endpoint=self.hub_endpoint,
                                        cache_dir=self.hub_cache_dir)
        if parsed.kind == "hub":
            self._observe("disk", started)
        return await self.put(adapter_id, files.config_raw, files.weights_raw,
                              StoredMeta(files.origin, files.revision), replace)

    async def put(self, adapter_id: str, config_raw: bytes, weights_raw: bytes,
                  meta: StoredMeta, replace: bool) -> StoredAdapter:
        """Validate against the base model, store a new version, register it in the engine."""
        adapter = await asyncio.to_thread(load_adapter_bytes, config_raw, weights_raw,
                                          self.llm.lora.spec)
        meta = StoredMeta(meta.source, meta.revision, adapter.max_rank, adapter.targets)
        stored = await asyncio.to_thread(self.store.put, adapter_id, config_raw, weights_raw,
                                         meta, replace)
        await self.engine.call(self.llm.add_adapter, adapter_id, adapter, stored.path)
        old = self.records.get(adapter_id)
        self.records[adapter_id] = AdapterRecord(stored, in_engine=True,
                                                 pinned=old.pinned if old else False)
        return stored

    # ---- up: disk -> host -> device ----------------------------------------------------------
    async def to_host(self, adapter_id: str) -> None:
        """Parse the stored copy and register it in the engine, unless it already is."""
        record = self.record(adapter_id)
        if record.in_engine:
            return
        self.loading.add(adapter_id)
        try:
            started = time.perf_counter()
            adapter = await asyncio.to_thread(load_adapter, record.stored.path,
                                              self.llm.lora.spec)
            self._observe("host", started)
            await self.engine.call(self.llm.add_adapter, adapter_id, adapter, record.stored.path)
            record.in_engine = True
        finally:
            self.loading.discard(adapter_id)

    async def to_device(self, adapter_id: str) -> None:
        """Into a device slot if one is free (else it waits in host memory)."""
        started = time.perf_counter()
        await self.engine.call(self.llm.load_adapter, adapter_id)
        self._observe("device", started)

    async def pin(self, adapter_id: str, pinned: bool) -> None:
        await self.engine.call(self.llm.pin_adapter, adapter_id, pinned)
        self.record(adapter_id).pinned = pinned

    # ---- down: device -> host -> disk -> gone ------------------------------------------------
    async def evict(self, adapter_id: str) -> None:
        """Off the device and out of host memory (down to disk); 409 while a request runs on it
        or it is pinned."""
        record = self.record(adapter_id)
        if record.in_engine:
            if not await self.engine.call(self.llm.evict_adapter, adapter_id):
                raise APIError(409, f"adapter {adapter_id!r} is in use by running requests; "
                                    "retry when they finish", code="adapter_busy")

    async def drop(self, adapter_id: str) -> None:
        """Out of the engine (its requests aborted) and the records; the stored copy stays."""
        record = self.record(adapter_id)
        if record.in_engine:
            await self.engine.call(self.llm.remove_adapter, adapter_id)
        del self.records[adapter_id]

    async def remove(self, adapter_id: str, *, missing_ok: bool = False) -> None:
        """`drop`, then delete the stored copy (`missing_ok`: it may be gone already)."""
        await self.drop(adapter_id)
        try:
            await asyncio.to_thread(self.store.delete, adapter_id)
        except AdapterNotFound:
            if not missing_ok:
                raise

    def _observe(self, tier: str, started: float) -> None:
        self.metrics.adapter_load_seconds.labels(tier).observe(time.perf_counter() - started)
        if tier != "device":  # the engine counts its own device loads
            self.metrics.tiers.loads[tier] += 1

