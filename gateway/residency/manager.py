"""The adapter residency manager: what a request's admission asks (`adapter_for` a model
name, `ensure_ready` on this replica), the admin verbs (upload, register, load, evict, pin,
unpin, delete, get, list), and this replica's side of the registry.

The tiers (disk store, host copies, device slots) and the moves between them are in
gateway/residency/tiers.py; this module decides when to move, serializes the moves and
announces them. One asyncio lock per adapter id serializes that id's changes and its first load, so
concurrent requests for a cold adapter trigger one load while requests for other adapters keep
flowing. Local sources are accepted from HTTP callers too (vLLM does the same); the admin key
guards those routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import defaultdict

from adapters.errors import AdapterNotFound
from adapters.ids import validate_adapter_id
from adapters.registry import (
    EVENT_DELETED,
    EVENT_REPLACED,
    AdapterEvent,
    ReplicaState,
    make_registry,
)
from adapters.sources import HUB_SCHEME, InvalidSource, hub_allowed, parse_source
from adapters.store import AdapterExists
from adapters.store_meta import StoredAdapter, StoredMeta
from engine.async_engine import AsyncEngine
from engine.snapshot import EngineSnapshot
from gateway.config import ServerConfig
from gateway.errors import APIError
from gateway.metrics import Metrics
from gateway.residency.info import AdapterInfo, adapter_info, catalog_entry
from gateway.residency.tiers import AdapterRecord, AdapterTiers

logger = logging.getLogger(__name__)
DEFAULT_ADAPTER_DIR = os.path.join("~", ".cache", "lora-gateway", "adapters")
PUBLISH_INTERVAL_S = 1.0
UPLOAD_SOURCE = "upload"


class AdapterManager:
    """`AdapterManager(config, engine)`: the adapters of the engine `engine` (an AsyncEngine)
    serves, stored under config.adapter_dir, announced to config.redis_url's registry."""

    def __init__(self, config: ServerConfig, engine: AsyncEngine, metrics: Metrics | None = None,
                 *, hub_endpoint: str | None = None, hub_cache_dir: str | None = None):
        self.base_name, self.engine = config.model_name, engine
        self.adapter_dir = os.path.expanduser(config.adapter_dir or DEFAULT_ADAPTER_DIR)
        self.tiers = AdapterTiers(
            self.adapter_dir, engine, metrics or Metrics(),
            hub_endpoint=hub_endpoint or os.environ.get("HF_ENDPOINT") or None,
            hub_cache_dir=hub_cache_dir or os.environ.get("HF_HUB_CACHE") or None)
        self.hub_allow = list(config.hub_allow)
        self.replica_id, self.url = config.replica, config.reachable_url
        self.registry = make_registry(config.redis_url, self.replica_id)
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._publisher: asyncio.Task | None = None

    @property
    def records(self) -> dict[str, AdapterRecord]:
        return self.tiers.records

    # ---- life cycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Open the store (every stored adapter is known again, parsed on first use), join
        the registry and start the residency heartbeat."""
        stored_adapters = await self.tiers.open()
        await self.registry.start()
        self.registry.subscribe(self._on_event)
        for stored in stored_adapters:
            self.records[stored.adapter_id] = AdapterRecord(stored)
            if await self.registry.get_adapter(stored.adapter_id) is None:
                await self.registry.put_adapter(catalog_entry(stored))
        logger.info("%d stored adapter(s) in %s", len(self.records), self.adapter_dir)
        self._publisher = asyncio.create_task(self._publish_loop())

    async def close(self) -> None:
        if self._publisher is not None:
            self._publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._publisher
        await self.registry.close()
        self.tiers.close()

    # ---- the request path ----------------------------------------------------------------
    def adapter_for(self, model: str) -> str | None:
        """The adapter id a request's `model` names (None: the base model), from names alone:
        a registered adapter, or a Hub repo --hub-allow lets us fetch; else 404."""
        if model == self.base_name:
            return None
        if model in self.records:
            return model
        repo_id = self._hub_on_demand(model)
        if repo_id is None:
            raise APIError.model_not_found(model)
        return repo_id

    async def ensure_ready(self, adapter_id: str) -> None:
        """Make `adapter_id` (from adapter_for) servable here: fetched from the Hub if it is
        new, parsed into host memory if it is only on disk. One load per cold adapter."""
        record = self.records.get(adapter_id)
        if record is not None and record.in_engine:
            return  # the hot path: no lock, no await
        if record is None:
            async with self._locks[adapter_id]:
                if adapter_id not in self.records:
                    await self._add(adapter_id, HUB_SCHEME + adapter_id, conflict=None,
                                    replace=False)
        await self._ensure_in_engine(adapter_id)

    def _hub_on_demand(self, model: str) -> str | None:
        """ORG/REPO or hf://ORG/REPO allowed by --hub-allow, else None (no revisions here)."""
        if not self.hub_allow or "@" in model:
            return None
        try:
            source = parse_source(model, allow_local=False)
        except (InvalidSource, AdapterNotFound):
            return None
        if source.kind != "hub" or not hub_allowed(source.repo_id, self.hub_allow):
            return None
        return source.repo_id

    async def _ensure_in_engine(self, adapter_id: str) -> None:
        """Disk -> host once: concurrent callers for a cold adapter wait on the one load."""
        async with self._locks[adapter_id]:
            await self.tiers.to_host(adapter_id)
        await self.publish()

    # ---- registering ---------------------------------------------------------------------
    async def upload(self, adapter_id: str, config_raw: bytes, weights_raw: bytes,
                     replace: bool = False) -> AdapterInfo:
        self._check_id(adapter_id)
        async with self._locks[adapter_id]:
            self._check_free(adapter_id, replace, conflict=409)
            await self._announce(await self.tiers.put(adapter_id, config_raw, weights_raw,
                                                      StoredMeta(UPLOAD_SOURCE), replace))
        return await self.get(adapter_id)

    async def register(self, adapter_id: str, source: str, replace: bool = False) -> AdapterInfo:
        """A Hub (hf://ORG/REPO[@REV], ORG/REPO) or local (a server directory) source."""
        self._check_id(adapter_id)
        async with self._locks[adapter_id]:
            await self._add(adapter_id, source, conflict=409, replace=replace)
        return await self.get(adapter_id)

    async def load(self, adapter_id: str, source: str | None = None,
                   replace: bool = False) -> AdapterInfo:
        """Bring an adapter into a device slot if one is free (else it waits in host memory).
        With `source` (vLLM's load_lora_adapter), register it first; an existing id then
        needs `replace` (else 400 adapter_exists, as vLLM answers)."""
        if source is not None:
            self._check_id(adapter_id)
            async with self._locks[adapter_id]:
                await self._add(adapter_id, source, conflict=400, replace=replace)
        await self._ensure_in_engine(adapter_id)
        await self.tiers.to_device(adapter_id)
        await self.publish()
        return await self.get(adapter_id)

    async def _add(self, adapter_id: str, source: str, *, conflict: int | None,
                   replace: bool) -> None:
        """Fetch, validate, store, register and announce; the caller holds the id's lock."""
        if conflict is not None:
            self._check_free(adapter_id, replace, conflict)
        await self._announce(await self.tiers.fetch(adapter_id, source, replace))

    async def _announce(self, stored: StoredAdapter) -> None:
        await self.registry.put_adapter(catalog_entry(stored))  # announces "replaced" if it was
        await self.publish()
        logger.info("adapter %s v%d registered from %s", stored.adapter_id, stored.version,
                    stored.source)

    def _check_id(self, adapter_id: str) -> None:
        validate_adapter_id(adapter_id)
        if adapter_id == self.base_name:
            raise APIError.bad_request(f"{adapter_id!r} is the base model's name; pick another "
                                       "adapter id", param="adapter_id")

    def _check_free(self, adapter_id: str, replace: bool, conflict: int) -> None:
        if adapter_id in self.records and not replace:
            if conflict == 400:
                raise APIError.bad_request(
                    f"adapter {adapter_id!r} is already loaded; unload it first or pass "
                    "load_inplace=true to replace it", param="lora_name", code="adapter_exists")
            raise AdapterExists(f"adapter {adapter_id!r} already exists (version "
                                f"{self.records[adapter_id].stored.version}); pass replace=true "
                                "to replace it or delete it first")

    # ---- residency verbs -----------------------------------------------------------------
    async def evict(self, adapter_id: str) -> AdapterInfo:
        """Down to disk; 409 while a request runs on it or it is pinned."""
        await self.tiers.evict(adapter_id)
        await self.publish()
        return await self.get(adapter_id)

    async def pin(self, adapter_id: str, pinned: bool = True) -> AdapterInfo:
        await self._ensure_in_engine(adapter_id)
        await self.tiers.pin(adapter_id, pinned)
        return await self.get(adapter_id)

    async def unpin(self, adapter_id: str) -> AdapterInfo:
        return await self.pin(adapter_id, False)

    async def delete(self, adapter_id: str) -> None:
        """Forget it everywhere: engine (its requests aborted), store, registry catalog."""
        async with self._locks[adapter_id]:
            await self.tiers.remove(adapter_id)
        await self.registry.delete_adapter(adapter_id)  # announces "deleted"
        await self.publish()
        logger.info("adapter %s deleted", adapter_id)

    # ---- what the OpenAI handlers call ----------------------------------------------------------
    def list_models(self) -> list[AdapterRecord]:
        return list(self.records.values())

    def check_loaded(self, name: str) -> None:
        self.tiers.record(name)

    async def unload(self, name: str) -> None:
        """vLLM's unload: forgets the adapter for good (memory and the stored copy)."""
        await self.delete(name)

    def residency(self, name: str, snapshot: EngineSnapshot | None) -> str:
        return snapshot.residency.get(name, "disk") if snapshot is not None else "disk"

    # ---- reading -------------------------------------------------------------------------
    async def get(self, adapter_id: str) -> AdapterInfo:
        record = self.tiers.record(adapter_id)
        return adapter_info(record, await self.engine.snapshot())

    async def list(self) -> list[AdapterInfo]:
        snapshot = await self.engine.snapshot()
        return [adapter_info(r, snapshot) for _, r in sorted(self.records.items())]

    # ---- registry ------------------------------------------------------------------------
    async def publish(self) -> None:
        """This replica's residency, loads in flight, free slots and queue depth."""
        snap = await self.engine.snapshot()
        await self.registry.publish_state(ReplicaState(
            self.replica_id, self.url, tuple(snap.resident), tuple(sorted(self.tiers.loading)),
            snap.free_slots, snap.num_waiting, time.time()))

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(PUBLISH_INTERVAL_S)
            try:
                await self.publish()
            except Exception:  # the engine stopping, say: the next tick tries again
                logger.exception("publishing residency failed")

    async def _on_event(self, event: AdapterEvent) -> None:
        """Another replica deleted or replaced an adapter: drop our stale copy."""
        if event.origin == self.replica_id or event.adapter_id not in self.records:
            return
        adapter_id = event.adapter_id
        if event.kind == EVENT_REPLACED:
            entry = await self.registry.get_adapter(adapter_id)
            if entry is not None and entry.sha256 == self.records[adapter_id].stored.sha256:
                return  # same bytes as ours
            async with self._locks[adapter_id]:
                if entry is not None and entry.source.startswith(HUB_SCHEME):
                    await self.tiers.drop(adapter_id)
                    await self._add(adapter_id, entry.source, conflict=None, replace=True)
                else:  # an upload we cannot fetch: better gone than stale
                    await self.tiers.remove(adapter_id, missing_ok=True)
        elif event.kind == EVENT_DELETED:
            async with self._locks[adapter_id]:
                if adapter_id in self.records:
                    await self.tiers.remove(adapter_id, missing_ok=True)
        logger.info("adapter %s %s by replica %s: local copy dropped", adapter_id, event.kind,
                    event.origin or "?")
        await self.publish()
