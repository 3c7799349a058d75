"""One replica's adapters across its tiers, and the moves between them.

Remote: listed in the fleet's catalog, not on this replica yet (gateway/residency/fetch.py says
where the bytes come from). Disk: the store under --adapter-dir (versioned, known again after a
restart, parsed lazily on first use). Host and device: inside the engine (LRU host copies and
device slots, see engine/lora/manager.py). Every adapter is validated against the base model off the
engine thread before anything is stored; the engine thread only copies tensors. With a shared
object store, uploads and path registrations are written through to it before they count.

The moves take no locks: AdapterManager (gateway/residency/manager.py) holds the adapter
id's lock around each one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from loragw.adapters.base_identity import BaseIdentity
from loragw.adapters.chat_files import NO_CHAT, AdapterChat, chat_from_files
from loragw.adapters.errors import AdapterNotFound
from loragw.adapters.format import parse_adapter
from loragw.adapters.object_store import ObjectStore
from loragw.adapters.registry import CatalogEntry
from loragw.adapters.sources import parse_source, resolve_source
from loragw.adapters.store import AdapterStore
from loragw.adapters.store_bases import open_base_store
from loragw.adapters.store_meta import StoredAdapter, StoredMeta
from loragw.adapters.types import FileDigests
from loragw.engine.api import EngineClient
from loragw.gateway.common.errors import APIError
from loragw.gateway.common.records import AdapterRecord, not_registered
from loragw.gateway.observe.metrics import Metrics
from loragw.gateway.residency.drafts import attach_draft
from loragw.gateway.residency.fetch import fetch_bytes

if TYPE_CHECKING:  # imported only when tracing
    from loragw.gateway.observe.tracing import Tracing

# (an adapter's chat, the tokens its tokenizer adds) -> None, or AdapterError for what the
# gateway cannot serve of it (gateway/openai/adapter_chats.py); None: anything goes
ChatCheck = Callable[[AdapterChat, tuple[str, ...]], None]


class AdapterTiers:
    def __init__(self, adapter_dir: str, engine: EngineClient, metrics: Metrics,
                 *, hub_endpoint: str | None, hub_cache_dir: str | None,
                 object_store: ObjectStore | None = None, tracing: Tracing | None = None,
                 check_chat: ChatCheck | None = None):
        self.adapter_dir, self.engine, self.metrics = adapter_dir, engine, metrics
        self.check_chat = check_chat
        self.hub_endpoint, self.hub_cache_dir = hub_endpoint, hub_cache_dir
        self.object_store = object_store
        self.tracing = tracing  # None: no spans (no --otlp-traces-endpoint)
        self.store: AdapterStore | None = None  # opened by open()
        self.records: dict[str, AdapterRecord] = {}
        self.loading: set[str] = set()  # ids being parsed into host memory right now

    async def open(self, base: BaseIdentity, versions_kept: int = 1) -> list[StoredAdapter]:
        """Open `base`'s store under the adapter dir; its adapters, for the caller to
        register."""
        self.store = await asyncio.to_thread(open_base_store, self.adapter_dir, base,
                                             self.engine.adapter_spec, versions_kept)
        return await asyncio.to_thread(self.store.list)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def record(self, adapter_id: str) -> AdapterRecord:
        record = self.records.get(adapter_id)
        if record is None:
            raise not_registered(adapter_id)
        return record

    # ---- onto disk (and into the engine) -----------------------------------------------------
    async def fetch(self, adapter_id: str, source: str, version: int, owner: str = "",
                    draft_source: str = "", chat: AdapterChat = NO_CHAT) -> StoredAdapter:
        """A local, Hub or s3:// source, fetched, validated and stored; see `put` (`chat`: what
        the caller set, over the chat files the source holds). Only a path's bytes are written
        through to the object store (the others' sources serve any replica)."""
        parsed = parse_source(source)
        started = time.perf_counter()
        files = await asyncio.to_thread(resolve_source, parsed, endpoint=self.hub_endpoint,
                                        cache_dir=self.hub_cache_dir)
        if parsed.kind != "local":
            self._observe("disk", started, adapter_id, version)
        return await self.put(adapter_id, files.config_raw, files.weights_raw,
                              StoredMeta(files.origin, files.revision, version=version,
                                         owner=owner, draft_source=draft_source, chat=chat),
                              write_through=parsed.kind == "local", chat_files=files.chat_files)

    async def put(self, adapter_id: str, config_raw: bytes, weights_raw: bytes,
                  meta: StoredMeta, write_through: bool = True,
                  chat_files: Mapping[str, bytes] | None = None) -> StoredAdapter:
        """Validate against the base model (and its draft LoRA against the draft model, which
        then drafts for it) and its chat (`meta.chat` over its `chat_files`), write through to
        the object store (if there is one and `write_through`), store `meta.version` here,
        register it in the engine."""
        chat = await asyncio.to_thread(self._chat, meta.chat, chat_files or {})
        digests = FileDigests.of(config_raw, weights_raw)  # once, for every use below
        adapter = await asyncio.to_thread(parse_adapter, config_raw, weights_raw,
                                          self.engine.adapter_spec, digests.weights)
        if meta.draft_source:
            await self._attach_draft(adapter_id, meta.draft_source)
        key = meta.object_key
        if write_through and self.object_store is not None:
            key = await asyncio.to_thread(self.object_store.put, config_raw, weights_raw,
                                          digests)
        meta = StoredMeta(meta.source, meta.revision, adapter.max_rank, adapter.targets,
                          meta.version, key, adapter.warnings, meta.owner,
                          draft_source=meta.draft_source, chat=chat)
        stored = await asyncio.to_thread(self.store.put, adapter_id, config_raw, weights_raw,
                                         meta, True, digests)
        started = time.perf_counter()
        await self.engine.add_adapter(adapter_id, stored.path, adapter, meta.version)
        self._observe("host", started, adapter_id, meta.version)
        return stored

    async def mirror(self, entry: CatalogEntry) -> StoredAdapter:
        """A catalog adapter's bytes onto this disk and into the engine (fetch.py says from
        where; verified before they are parsed), as the catalog's version."""
        started = time.perf_counter()
        config_raw, weights_raw = await asyncio.to_thread(
            fetch_bytes, entry, self.object_store, hub_endpoint=self.hub_endpoint,
            hub_cache_dir=self.hub_cache_dir)
        self._observe("disk", started, entry.adapter_id, entry.version)
        meta = StoredMeta(entry.source, entry.revision, version=entry.version,
                          object_key=entry.object_key, owner=entry.owner,
                          draft_source=entry.draft_source, chat=entry.chat)
        return await self.put(entry.adapter_id, config_raw, weights_raw, meta,
                              write_through=False)

    # ---- up: disk -> host -> device ----------------------------------------------------------
    async def to_host(self, adapter_id: str) -> None:
        """Parse the stored copy (fetching it first if it is remote) and register it in the
        engine, unless it already is."""
        record = self.record(adapter_id)
        if record.in_engine:
            return
        self.loading.add(adapter_id)
        try:
            if record.stored is None:
                record.stored = await self.mirror(record.entry)
            else:  # read and parsed by the engine, off its step loop (its loader thread)
                started = time.perf_counter()
                await self.engine.add_adapter(adapter_id, record.stored.path,
                                              catalog_version=record.entry.version)
                self._observe("host", started, adapter_id, record.entry.version)
                if record.stored.draft_source:
                    await self._attach_draft(adapter_id, record.stored.draft_source)
            record.in_engine = True
        finally:
            self.loading.discard(adapter_id)

    async def to_device(self, adapter_id: str) -> None:
        """Into a device slot if one is free (else it waits in host memory); the engine
        counts and times its slot fills (a request's own fill lies in its queue span)."""
        started = time.perf_counter()
        await self.engine.to_device(adapter_id)
        if self.tracing is not None:
            self.tracing.adapter_load(adapter_id, self.record(adapter_id).entry.version,
                                      "device", time.perf_counter() - started)

    async def pin(self, adapter_id: str, pinned: bool) -> None:
        await self.engine.pin_adapter(adapter_id, pinned)
        self.record(adapter_id).pinned = pinned

    # ---- down: device -> host -> disk -> gone ------------------------------------------------
    async def evict(self, adapter_id: str) -> None:
        """Off the device and out of host memory (down to disk); 409 while a request runs on it
        or it is pinned."""
        record = self.record(adapter_id)
        if record.in_engine:
            if not await self.engine.evict_adapter(adapter_id):
                raise APIError(409, f"adapter {adapter_id!r} is in use by running requests; "
                                    "retry when they finish", code="adapter_busy")

    async def forget(self, adapter_id: str) -> None:
        """Out of the engine (its requests aborted) and off this disk; the record stays, as
        remote (its catalog entry is the caller's to change or drop)."""
        record = self.record(adapter_id)
        if record.in_engine:
            await self.engine.remove_adapter(adapter_id)
            record.in_engine = False
        if record.stored is not None:
            record.stored = None
            try:
                await asyncio.to_thread(self.store.delete, adapter_id)
            except AdapterNotFound:
                pass  # gone already

    async def supersede(self, adapter_id: str) -> None:
        """The catalog has a newer version: this disk's copy becomes a kept earlier one. The
        engine finishes the requests already on it (the next version replaces it there the way
        a local replace does: engine/lora/manager.py), the next request fetches the new one."""
        record = self.record(adapter_id)
        record.in_engine = False
        if record.stored is not None:
            record.stored = None
            await asyncio.to_thread(self.store.supersede, adapter_id)

    async def remove(self, adapter_id: str) -> None:
        """`forget`, and the record too."""
        await self.forget(adapter_id)
        del self.records[adapter_id]

    def _chat(self, asked: AdapterChat, files: Mapping[str, bytes]) -> AdapterChat:
        """The chat an adapter is stored with: the caller's fields over its files', checked."""
        from_files, added = chat_from_files(files, "the adapter's ")
        chat = asked.over(from_files).check()
        if self.check_chat is not None:
            self.check_chat(chat, added)
        return chat

    async def _attach_draft(self, adapter_id: str, source: str) -> None:
        await attach_draft(self.engine, self.store.root, adapter_id, source,
                           hub_endpoint=self.hub_endpoint, hub_cache_dir=self.hub_cache_dir)

    def _observe(self, tier: str, started: float, adapter_id: str, version: int | None) -> None:
        seconds = time.perf_counter() - started
        self.metrics.observe_load(tier, seconds)
        if self.tracing is not None:  # a span under the request (or admin call) that waited
            self.tracing.adapter_load(adapter_id, version, tier, seconds)

