"""This replica's view of the fleet's catalog (the registry), kept current.

The catalog is the fleet's truth: every adapter it lists is an AdapterRecord here, "remote"
until first used (then fetched from the object store or its source: fetch.py). Changes reach
this view four ways, each applied under the adapter id's lock:

    events      another replica added, replaced or deleted an adapter: pub/sub, milliseconds
    sync        the whole catalog, read every heartbeat: what an event may have missed
    refresh     one entry, read by admission before each request for it, so no request is
                served with weights the catalog has replaced or deleted
    adopt       at start-up, this disk's adapters against the catalog

A record whose catalog entry has a newer version becomes remote: its local copy is kept as an
earlier version (gateway/residency/versions.py) and the requests running on it finish there;
one the catalog no longer lists is removed (its requests end). An absence counts as a deletion only while the registry is healthy (a Redis that
restarted empty is refilled by the replicas first: adapters.registry_redis).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from loragw.adapters.object_store import ObjectStore
from loragw.adapters.registry import (
    EVENT_DELETED,
    AdapterEvent,
    CatalogEntry,
    Registry,
)
from loragw.adapters.store_meta import StoredAdapter
from loragw.gateway.common.records import AdapterRecord
from loragw.gateway.residency.fetch import UPLOAD_SOURCE
from loragw.gateway.residency.info import catalog_entry
from loragw.gateway.residency.tiers import AdapterTiers
from loragw.gateway.residency.versions import PinnedVersions, object_keys

logger = logging.getLogger(__name__)


def same_bytes(entry: CatalogEntry, stored: StoredAdapter) -> bool:
    configs = (entry.config_sha256, stored.config_sha256)
    return entry.sha256 == stored.sha256 and (not all(configs) or configs[0] == configs[1])


class FleetCatalog:
    def __init__(self, registry: Registry, tiers: AdapterTiers, pinned: PinnedVersions,
                 locks: defaultdict[str, asyncio.Lock], replica_id: str, shared: bool):
        self.registry, self.tiers, self.pinned, self.locks = registry, tiers, pinned, locks
        self.replica_id, self.shared = replica_id, shared

    @property
    def records(self) -> dict[str, AdapterRecord]:
        return self.tiers.records

    def entry_for(self, stored: StoredAdapter) -> CatalogEntry:
        """The catalog entry of an adapter this replica just stored. Its holder is this
        replica when no other can fetch the bytes: an upload, or a path, not in the store."""
        anyone = stored.object_key or stored.source.startswith(("hf://", "s3://"))
        local = stored.source == UPLOAD_SOURCE or stored.source.startswith("/")
        return catalog_entry(stored, holder="" if anyone or not local else self.replica_id)

    # ---- owners (DESIGN.md, Tenants) ----------------------------------------------------------
    async def owner(self, adapter_id: str) -> str | None:
        """The catalog's owner of `adapter_id` now ("": shared), None if there is no such
        adapter: what the tenant rules read (gateway/tenants/access.py)."""
        await self.refresh(adapter_id)
        record = self.records.get(adapter_id)
        return record.entry.owner if record is not None else None

    def owner_for(self, adapter_id: str, requested: str | None) -> str:
        """The owner a new version of `adapter_id` gets: `requested`, else the one it has."""
        record = self.records.get(adapter_id)
        return requested if requested is not None else (record.entry.owner if record else "")

    # ---- start-up --------------------------------------------------------------------------
    async def adopt(self, stored_adapters: list[StoredAdapter]) -> None:
        """This disk's adapters against the catalog. A non-empty catalog is the truth: copies
        it lists with other bytes, or does not list (deleted while we were away), are dropped.
        An empty one (a new fleet, a single replica, a Redis that lost its data) is filled
        from this disk."""
        catalog = {e.adapter_id: e for e in await self.registry.list_adapters()}
        trusted = self.shared and self.registry.healthy and bool(catalog)
        for stored in stored_adapters:
            entry = catalog.get(stored.adapter_id)
            if entry is None and not trusted:
                entry = self.entry_for(stored)
                await self.registry.put_adapter(entry)
            elif entry is None or not same_bytes(entry, stored):
                why = "is no longer in" if entry is None else "has other weights in"
                logger.warning("adapter %s on this disk %s the fleet's catalog; dropping the "
                               "local copy", stored.adapter_id, why)
                await asyncio.to_thread(self.tiers.store.delete, stored.adapter_id)
                if entry is None:
                    continue
                stored = None
            self.records[entry.adapter_id] = AdapterRecord(entry, stored)
        for adapter_id, entry in catalog.items():
            self.records.setdefault(adapter_id, AdapterRecord(entry))

    # ---- keeping current -------------------------------------------------------------------
    async def refresh(self, adapter_id: str) -> None:
        """The catalog's word on one adapter, now (admission calls this per request)."""
        if not self.shared or not self.registry.healthy:
            return
        entry = await self.registry.get_adapter(adapter_id)
        record = self.records.get(adapter_id)
        if entry is None and record is not None and self.registry.healthy:
            async with self.locks[adapter_id]:
                await self._drop_unlisted(adapter_id)
        elif entry is not None and (record is None or record.entry != entry):
            async with self.locks[adapter_id]:
                await self.follow(entry)

    async def follow(self, entry: CatalogEntry) -> None:
        """Make this replica's record of entry's id match it; the caller holds the id's lock."""
        record = self.records.get(entry.adapter_id)
        if record is None:
            self.records[entry.adapter_id] = AdapterRecord(entry)
            logger.info("adapter %s v%d from the catalog (%s)", entry.adapter_id, entry.version,
                        entry.source)
        elif not record.entry.same_weights(entry):
            await self.tiers.supersede(entry.adapter_id)  # running requests finish on it
            record.entry = entry
            logger.info("adapter %s replaced in the catalog (v%d): local copy kept as an "
                        "earlier version", entry.adapter_id, entry.version)
        else:
            record.entry = entry  # same bytes; where they live may have changed
        await self.pinned.follow(entry, entry.adapter_id)  # earlier versions no longer kept

    async def _drop_unlisted(self, adapter_id: str) -> None:
        """Remove a record the catalog does not list, if it still does not (the id's lock is
        held: a registration of ours in flight has put its entry by now)."""
        if adapter_id not in self.records:
            return
        if await self.registry.get_adapter(adapter_id) is None and self.registry.healthy:
            await self.tiers.remove(adapter_id)
            await self.pinned.follow(None, adapter_id)
            logger.info("adapter %s deleted from the catalog: local copy dropped", adapter_id)

    async def on_event(self, event: AdapterEvent) -> None:
        """Another replica changed the catalog."""
        if event.origin == self.replica_id:
            return
        adapter_id = event.adapter_id
        if event.kind == EVENT_DELETED:
            async with self.locks[adapter_id]:
                await self._drop_unlisted(adapter_id)
            return
        entry = await self.registry.get_adapter(adapter_id)
        if entry is not None:
            async with self.locks[adapter_id]:
                await self.follow(entry)

    async def sync(self) -> None:
        """The whole catalog against this view (every heartbeat)."""
        if not self.shared or not self.registry.healthy:
            return
        entries = {e.adapter_id: e for e in await self.registry.list_adapters()}
        if not self.registry.healthy:
            return  # the read fell back to what we knew: nothing new to learn
        for adapter_id, entry in entries.items():
            record = self.records.get(adapter_id)
            if record is None or record.entry != entry:
                async with self.locks[adapter_id]:
                    await self.follow(entry)
        for adapter_id in [a for a in self.records if a not in entries]:
            async with self.locks[adapter_id]:
                await self._drop_unlisted(adapter_id)

    async def announced(self, old: CatalogEntry | None, new: CatalogEntry,
                        store: ObjectStore | None) -> None:
        """After this replica replaced `old` by `new`: its earlier versions no longer kept
        leave the engine and the disk, and their objects the store. The caller holds the
        id's lock."""
        await self.pinned.follow(new, new.adapter_id)
        if old is not None:
            await self.collect(object_keys(old) - object_keys(new), store)

    async def collect(self, keys: set[str], store: ObjectStore | None) -> None:
        """Delete the object-store pairs at `keys` that no catalog entry (nor a version one
        keeps) refers to."""
        if not keys or store is None:
            return
        used = {v.object_key for e in await self.registry.list_adapters() for v in (e, *e.kept)}
        for key in sorted(keys - used):
            try:
                await asyncio.to_thread(store.delete, key)
                logger.info("object store: deleted %s (no catalog entry refers to it)", key)
            except Exception as exc:  # the bucket keeps an orphan; the catalog is right anyway
                logger.warning("object store: could not delete %s: %s", key, exc)
