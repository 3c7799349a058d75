"""The adapter residency manager: what admission asks (`locate` a model name, `ensure_ready`
here), the admin verbs (upload, register, load, evict, pin, unpin, delete, get, list), and this
replica's side of the registry (its state, published every heartbeat).

The tiers and the moves between them are in tiers.py, the fleet's catalog as this replica sees
it in catalog.py, earlier versions in versions.py; this module decides when to move,
serializes the moves and announces them. One asyncio lock per adapter id serializes that id's
changes and its first load (one load per cold adapter, other adapters keep flowing). Local
sources are accepted from HTTP callers too (as vLLM does); admin keys guard those routes."""

from __future__ import annotations

import asyncio
import logging
import os
from collections import defaultdict
from typing import TYPE_CHECKING

from loragw.adapters.alias_store import AliasBook
from loragw.adapters.base_identity import base_identity
from loragw.adapters.chat_files import NO_CHAT, AdapterChat
from loragw.adapters.object_store import ObjectStore
from loragw.adapters.registry import REGISTRY_PREFIX, make_registry
from loragw.adapters.store_meta import StoredAdapter, StoredMeta
from loragw.engine.api import EngineClient, EngineSnapshot
from loragw.gateway.common.config import ServerConfig
from loragw.gateway.common.errors import APIError
from loragw.gateway.common.records import AdapterRecord, Location
from loragw.gateway.observe.metrics import Metrics
from loragw.gateway.residency import fetch as sources
from loragw.gateway.residency.catalog import FleetCatalog
from loragw.gateway.residency.demand import DemandWindow
from loragw.gateway.residency.heartbeat import holders, replica_state, resident_on
from loragw.gateway.residency.info import AdapterInfo, adapter_info, residency
from loragw.gateway.residency.names import check_free, check_new_id, on_demand
from loragw.gateway.residency.tiers import AdapterTiers, ChatCheck
from loragw.gateway.residency.versions import PinnedVersions, object_keys, parse_pin, with_history
from loragw.gateway.tenants.keys import OPERATOR, Principal

if TYPE_CHECKING:  # imported only when tracing
    from loragw.gateway.observe.tracing import Tracing

logger = logging.getLogger(__name__)
PUBLISH_INTERVAL_S = 1.0  # this replica's state, and a read of the whole catalog


class AdapterManager:
    """`AdapterManager(config, engine)`: the adapters `engine` serves, stored under
    config.adapter_dir, announced to config.redis_url's registry."""

    def __init__(self, config: ServerConfig, engine: EngineClient,
                 metrics: Metrics | None = None,
                 *, hub_endpoint: str | None = None, hub_cache_dir: str | None = None,
                 tracing: Tracing | None = None, check_chat: ChatCheck | None = None,
                 demand: DemandWindow | None = None):  # what it serves, published with it
        self.base_name, self.engine = config.model_name, engine
        self.adapter_dir = config.adapter_path
        self.object_store = (ObjectStore(config.adapter_store_url)
                             if config.adapter_store_url else None)
        self.store_health = sources.StoreHealth(config.adapter_store_url)
        self.tiers = AdapterTiers(
            self.adapter_dir, engine, metrics or Metrics(),
            hub_endpoint=hub_endpoint or os.environ.get("HF_ENDPOINT") or None,
            hub_cache_dir=hub_cache_dir or os.environ.get("HF_HUB_CACHE") or None,
            object_store=self.object_store, tracing=tracing, check_chat=check_chat)
        self.hub_allow, self.s3_allow = list(config.hub_allow), list(config.s3_allow)
        self.replica_id, self.url = config.replica, config.reachable_url
        # adapters are keyed by base model: another base's are not this server's to list,
        # serve or forward to (adapters/base_identity.py)
        self.base = base_identity(engine.adapter_spec, config.model_name)
        self.registry_prefix = prefix = f"{REGISTRY_PREFIX}{self.base.key}:"
        self.registry = make_registry(config.redis_url, self.replica_id, prefix=prefix)
        self.aliases = AliasBook.open(config.redis_url, prefix)  # this base's, fleet-wide
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.versions_kept = config.adapter_versions_kept
        self.pinned = PinnedVersions(self.tiers)  # earlier versions, for requests that pin one
        self.catalog = FleetCatalog(self.registry, self.tiers, self.pinned, self._locks,
                                    self.replica_id, shared=bool(config.redis_url))
        self._publisher: asyncio.Task | None = None
        self.demand = demand or DemandWindow(config.demand_window_s, config.replica_tokens_per_s)

    @property
    def records(self) -> dict[str, AdapterRecord]:
        return self.tiers.records

    # ---- life cycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Open the stores, join the registry, match the disk to the catalog, start heartbeats."""
        await sources.check_store(self.object_store, self.catalog.shared)
        stored_adapters = await self.tiers.open(self.base, self.versions_kept)
        await self.registry.start()
        self.registry.subscribe(self.catalog.on_event)
        await self.catalog.adopt(stored_adapters)
        await self.aliases.sync()
        logger.info("%d adapter(s) in the catalog, %d on this disk (%s)", len(self.records),
                    len(stored_adapters), self.adapter_dir)
        self._publisher = asyncio.create_task(self._heartbeat())

    async def close(self) -> None:
        if self._publisher is not None:
            self._publisher.cancel()
            await asyncio.gather(self._publisher, return_exceptions=True)  # its CancelledError
        await self.registry.close()
        await self.aliases.close()
        self.tiers.close()

    # ---- the request path ----------------------------------------------------------------
    async def locate(self, model: str, principal: Principal = OPERATOR) -> Location:
        """Where a request's `model` (an alias already resolved to its target: the caller's
        `aliases.resolve`, once per request) can be served: the base model, a catalog adapter
        (this replica holds it or can fetch it, or only other replicas hold it), or a Hub /
        s3:// adapter --hub-allow / --s3-allow lets us fetch on first use; else 404, also for
        an adapter `principal` may not use (answered exactly as one that does not exist)."""
        if model == self.base_name:
            return Location(None, True)
        pinned_id, pin = parse_pin(model)  # bot@3, bot@sha256:...: one version of bot
        adapter_id, source = on_demand(pinned_id, self.hub_allow, self.s3_allow)
        source = source if pin is None else None
        await self.catalog.refresh(adapter_id)  # the catalog's word, per request
        record = self.records.get(adapter_id)
        if record is not None and not principal.may_use(adapter_id, record.entry.owner):
            raise APIError.model_not_found(model)
        if record is None:
            if source is None:
                raise APIError.model_not_found(model)
            return Location(adapter_id, True, source=source)
        if pin is not None and (older := self.pinned.locate(record.entry, pin, model,
                                                            self.replica_id)) is not None:
            return older
        if record.stored is not None:
            return Location(adapter_id, True, version=record.entry.version)
        if not sources.can_fetch(record.entry, self.object_store):  # only its holder has the bytes
            holder = record.entry.holder
            return Location(adapter_id, False, (holder,) if holder != self.replica_id else (),
                            version=record.entry.version)
        if sources.in_store(record.entry, self.object_store) and not await self.store_health.reachable():
            # the store is down: the replicas that hold it first, this one (a fetch) last
            states = await self.registry.replicas()
            return Location(adapter_id, True, holders(states, adapter_id, self.replica_id),
                            version=record.entry.version)
        return Location(adapter_id, True, version=record.entry.version)

    async def ensure_ready(self, location: Location) -> None:
        """Make a located adapter servable here: fetched if it is new or remote, parsed into
        host memory if it is only on disk. One load per cold adapter."""
        adapter_id = location.adapter_id
        record = self.records.get(adapter_id)
        if location.older:  # an earlier version, under its own engine name
            return await self.pinned.ensure_version(location, self._locks)
        if record is not None and record.in_engine:
            return  # the hot path: no lock, no await
        if record is None:
            async with self._locks[adapter_id]:
                if adapter_id not in self.records:
                    await self._add(adapter_id, location.source, conflict=None, replace=False)
        await self.ensure_in_engine(adapter_id)

    async def ensure_in_engine(self, adapter_id: str) -> None:
        """Remote/disk -> host once: concurrent callers for a cold adapter wait on one load."""
        async with self._locks[adapter_id]:
            with self.store_health.watching():  # down: the next requests go to its holders
                await self.tiers.to_host(adapter_id)
        await self.publish()

    # ---- registering ---------------------------------------------------------------------
    async def upload(self, adapter_id: str, config_raw: bytes, weights_raw: bytes,
                     replace: bool = False, owner: str | None = None, draft: str = "",
                     chat: AdapterChat = NO_CHAT,
                     chat_files: dict[str, bytes] | None = None) -> AdapterInfo:
        """`draft`: the source of its draft-model LoRA (speculative decoding), if any; `chat`
        over `chat_files` (adapters/chat_files.py): how it speaks chat, if not as the base."""
        check_new_id(adapter_id, self.base_name)
        await self.catalog.refresh(adapter_id)
        async with self._locks[adapter_id]:
            check_free(self.records, adapter_id, replace, conflict=409)
            meta = StoredMeta(sources.UPLOAD_SOURCE, version=self._next_version(adapter_id),
                              owner=self.catalog.owner_for(adapter_id, owner), draft_source=draft,
                              chat=chat)
            await self._announce(await self.tiers.put(adapter_id, config_raw, weights_raw, meta,
                                                      chat_files=chat_files))
        return await self.get(adapter_id)

    async def register(self, adapter_id: str, source: str, replace: bool = False,
                       owner: str | None = None, draft: str = "",
                       chat: AdapterChat = NO_CHAT) -> AdapterInfo:
        """A Hub (hf://ORG/REPO[@REV], ORG/REPO), s3:// or local (a server directory) source;
        `draft` as for `upload`, `chat` over the chat files the source holds."""
        check_new_id(adapter_id, self.base_name)
        await self.catalog.refresh(adapter_id)
        async with self._locks[adapter_id]:
            await self._add(adapter_id, source, conflict=409, replace=replace, owner=owner,
                            draft=draft, chat=chat)
        return await self.get(adapter_id)

    async def load(self, adapter_id: str, source: str | None = None,
                   replace: bool = False, owner: str | None = None) -> AdapterInfo:
        """Into a device slot if one is free (else it waits in host memory). With `source`
        (vLLM's load_lora_adapter) registered first: an existing id needs `replace` (else 400)."""
        if source is not None:
            check_new_id(adapter_id, self.base_name)
            await self.catalog.refresh(adapter_id)
            async with self._locks[adapter_id]:
                await self._add(adapter_id, source, conflict=400, replace=replace, owner=owner)
        await self.ensure_in_engine(adapter_id)
        await self.tiers.to_device(adapter_id)
        await self.publish()
        return await self.get(adapter_id)

    async def _add(self, adapter_id: str, source: str, *, conflict: int | None,
                   replace: bool, owner: str | None = None, draft: str = "",
                   chat: AdapterChat = NO_CHAT) -> None:
        """Fetch, validate, store, register and announce; the caller holds the id's lock."""
        if conflict is not None:
            check_free(self.records, adapter_id, replace, conflict)
        owner, version = self.catalog.owner_for(adapter_id, owner), self._next_version(adapter_id)
        await self._announce(await self.tiers.fetch(adapter_id, source, version, owner, draft,
                                                    chat))

    def _next_version(self, adapter_id: str) -> int:
        """One past the catalog's version and any this disk ever stored."""
        record = self.records.get(adapter_id)
        return max(self.tiers.store.next_version(adapter_id),
                   record.entry.version + 1 if record else 1)

    async def _announce(self, stored: StoredAdapter) -> None:
        """Record what was just stored, in the catalog too (the caller holds the id's lock)."""
        old = self.records.get(stored.adapter_id)
        entry = with_history(self.catalog.entry_for(stored), old.entry if old else None,
                             self.versions_kept)  # the versions before it still kept
        self.records[stored.adapter_id] = AdapterRecord(entry, stored, in_engine=True,
                                                        pinned=old.pinned if old else False)
        await self.registry.put_adapter(entry)
        await self.catalog.announced(old.entry if old else None, entry, self.object_store)
        await self.publish()
        logger.info("adapter %s v%d registered from %s%s", stored.adapter_id, stored.version,
                    stored.source, f" (object {entry.object_key})" if entry.object_key else "")

    # ---- residency verbs -----------------------------------------------------------------
    async def evict(self, adapter_id: str) -> AdapterInfo:
        """Down to disk; 409 while a request runs on it or it is pinned."""
        await self.tiers.evict(adapter_id)
        await self.publish()
        return await self.get(adapter_id)

    async def pin(self, adapter_id: str, pinned: bool = True) -> AdapterInfo:
        await self.ensure_in_engine(adapter_id)
        await self.tiers.pin(adapter_id, pinned)
        return await self.get(adapter_id)

    async def delete(self, adapter_id: str) -> None:
        """Forget it everywhere: engine (its requests aborted), disk, the catalog (every
        replica drops its copy), and its objects once no catalog entry refers to them."""
        await self.catalog.refresh(adapter_id)
        async with self._locks[adapter_id]:
            record = self.tiers.record(adapter_id)
            await self.tiers.remove(adapter_id)
            await self.pinned.follow(None, adapter_id)
            await self.registry.delete_adapter(adapter_id)  # announces "deleted"
        await self.catalog.collect(object_keys(record.entry), self.object_store)
        await self.publish()
        logger.info("adapter %s deleted", adapter_id)

    # ---- what the OpenAI handlers call ----------------------------------------------------------
    def residency(self, name: str, snapshot: EngineSnapshot | None) -> str:
        return residency(self.records.get(name), name, snapshot)

    def residencies(self, snapshot: EngineSnapshot | None) -> dict[str, str]:
        """Every adapter's tier here, and each earlier version held for pins (as `ID@N`)."""
        return ({n: residency(None, n, snapshot) for n in self.pinned.in_engine}
                | {name: self.residency(name, snapshot) for name in self.records})

    async def resident_on(self) -> dict[str, list[str]]:
        """adapter id -> the replicas that hold it in a device slot (from their heartbeats)."""
        return resident_on(await self.registry.replicas())

    # ---- reading -------------------------------------------------------------------------
    async def get(self, adapter_id: str) -> AdapterInfo:
        self.tiers.record(adapter_id)  # 404 if unknown
        return (await self.list([adapter_id]))[0]

    async def list(self, names: list[str] | None = None) -> list[AdapterInfo]:
        snapshot, where = await self.engine.snapshot(), await self.resident_on()
        return [adapter_info(self.records[n], residency(self.records[n], n, snapshot), snapshot,
                             where.get(n, [])) for n in names or sorted(self.records)]

    # ---- registry ------------------------------------------------------------------------
    async def publish(self) -> None:
        """This replica's residency (slots and beyond), loads, slots, queue depth, demand."""
        await self.registry.publish_state(replica_state(
            self.replica_id, self.url, await self.engine.snapshot(), self.records,
            self.tiers.loading, self.demand, self.engine.adapter_spec))

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(PUBLISH_INTERVAL_S)
            for step in (self.publish, self.catalog.sync, self.aliases.sync):
                try:
                    await step()
                except Exception:  # the engine stopping, say: the next tick tries again
                    logger.exception("residency heartbeat: %s failed", step.__name__)
