"""Versions you can pin: `bot@3`, `bot@sha256:PREFIX`; `bot` is the newest.

Every upload, registration or replace of an id makes an immutable version (number and sha256).
The catalog entry of the newest carries the earlier ones still kept (`CatalogEntry.kept`,
newest first, at most --adapter-versions-kept - 1), so which versions exist is one atomic fact
of the fleet's catalog. Their bytes: the shared object store (content-addressed, so a kept
version costs nothing extra there), the Hub at the commit it was fetched at, or the holder's
disk (adapters.store_kept). The newest is served under its id; an earlier one under the engine
name `ID@N` (EngineName), so the two never share a slot or prefix-cache blocks and a request
running on one version finishes on it while another arrives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from collections import defaultdict
from dataclasses import dataclass

from loragw.adapters.errors import short_name
from loragw.adapters.registry import CatalogEntry
from loragw.adapters.store import AdapterStore
from loragw.adapters.store_meta import StoredAdapter
from loragw.gateway.common.errors import APIError
from loragw.gateway.common.records import Location
from loragw.gateway.residency.fetch import can_fetch, fetch_bytes
from loragw.gateway.residency.tiers import AdapterTiers

logger = logging.getLogger(__name__)

# ID@N or ID@sha256:HEX (4 to 64 hex digits); '@' is never part of an adapter id
_PIN = re.compile(r"(?P<id>[^@]+)@(?:(?P<version>[1-9][0-9]{0,9})|sha256:(?P<sha>[0-9a-f]{4,64}))")
PIN_PATTERN = "@([1-9][0-9]{0,9}|sha256:[0-9a-f]{4,64})"  # _PIN's suffix, for the OpenAPI document
VERSION_HEADER = "X-Adapter-Version"


@dataclass(frozen=True, slots=True)
class Pin:
    """What `model` pinned: a version number, or a prefix of its weights' sha256."""

    version: int | None = None
    sha256_prefix: str | None = None


def parse_pin(model: str) -> tuple[str, Pin | None]:
    """(the adapter id, its pin) of `bot@3` / `bot@sha256:ab12...`; (model, None) otherwise."""
    match = _PIN.fullmatch(model)
    if match is None:
        return model, None
    version = match["version"]
    return match["id"], Pin(int(version) if version else None, match["sha"])


def engine_name(adapter_id: str, version: int) -> str:
    """The name the engine knows an earlier, pinned version by."""
    return f"{adapter_id}@{version}"


def header_value(adapter_id: str, version: int) -> str:
    return f"{adapter_id}@{version}"


def versions_of(entry: CatalogEntry) -> list[CatalogEntry]:
    """The newest and every kept version, newest first."""
    return [dataclasses.replace(entry, kept=()), *entry.kept]


def object_keys(entry: CatalogEntry) -> set[str]:
    """The object-store keys of every version `entry` carries."""
    return {e.object_key for e in versions_of(entry) if e.object_key}


def with_history(entry: CatalogEntry, previous: CatalogEntry | None,
                 versions_kept: int) -> CatalogEntry:
    """`entry` (a new version) carrying the versions before it that are still kept."""
    if previous is None or versions_kept <= 1:
        return dataclasses.replace(entry, kept=())
    earlier = [e for e in versions_of(previous) if e.version != entry.version]
    return dataclasses.replace(entry, kept=tuple(earlier[:versions_kept - 1]))


def resolve(entry: CatalogEntry, pin: Pin, model: str) -> CatalogEntry:
    """The version `pin` names among `entry`'s; 404 naming the kept versions otherwise."""
    versions = versions_of(entry)
    if pin.version is not None:
        found = [e for e in versions if e.version == pin.version]
    else:
        found = [e for e in versions if e.sha256.startswith(pin.sha256_prefix)]
    if found:
        return found[0]
    kept = ", ".join(header_value(e.adapter_id, e.version) for e in versions)
    raise APIError(404, f"The model {short_name(model)} does not exist: adapter "
                        f"{short_name(entry.adapter_id)} keeps the versions {kept} (newest "
                        "first; --adapter-versions-kept)", param="model",
                   code="model_not_found")


class PinnedVersions:
    """Earlier versions this replica serves for pins: on its disk (the store's kept copies)
    and in the engine under `ID@N`. The newest version is AdapterTiers' business."""

    def __init__(self, tiers: AdapterTiers):
        self.tiers, self.engine, self.object_store = tiers, tiers.engine, tiers.object_store
        self.in_engine: set[str] = set()  # engine names of the earlier versions registered

    @property
    def store(self) -> AdapterStore | None:
        return self.tiers.store  # open once the manager has started

    def locate(self, entry: CatalogEntry, pin: Pin, model: str,
               replica_id: str) -> Location | None:
        """Where the version of `entry`'s id that `pin` names is served: here if this replica
        has it or can fetch it, else on its holder; None when it is the newest (served as the
        id itself). 404 naming the kept versions when it names none."""
        version = resolve(entry, pin, model)
        if version.version == entry.version:
            return None
        here = (engine_name(version.adapter_id, version.version) in self.in_engine
                or can_fetch(version, self.object_store)
                or self.store.kept.get(version.adapter_id, version.version) is not None)
        holders = (version.holder,) if not here and version.holder != replica_id else ()
        return Location(version.adapter_id, here, holders, version=version.version, older=True)

    async def ensure_version(self, location: Location,
                             locks: defaultdict[str, asyncio.Lock]) -> None:
        """`ensure` of the earlier version `location` names, under its id's lock (404 if it
        is no longer kept)."""
        adapter_id, version = location.adapter_id, location.version
        async with locks[adapter_id]:
            newest = self.tiers.record(adapter_id).entry
            await self.ensure(resolve(newest, Pin(version), engine_name(adapter_id, version)))

    async def ensure(self, entry: CatalogEntry) -> str:
        """Version `entry` in the engine (fetched and verified if this disk lacks it); its
        engine name. The caller holds the id's lock."""
        name = engine_name(entry.adapter_id, entry.version)
        if name in self.in_engine:
            return name
        kept = self.store.kept
        stored = await asyncio.to_thread(kept.get, entry.adapter_id, entry.version)
        if stored is None or stored.sha256 != entry.sha256:
            config_raw, weights_raw = await asyncio.to_thread(
                fetch_bytes, entry, self.object_store, hub_endpoint=self.tiers.hub_endpoint,
                hub_cache_dir=self.tiers.hub_cache_dir)
            stored = await asyncio.to_thread(kept.put, _stored(entry), config_raw, weights_raw)
        # read and validated by the engine
        await self.engine.add_adapter(name, stored.path, catalog_version=entry.version)
        self.in_engine.add(name)
        logger.info("adapter %s v%d serving pinned requests as %s", entry.adapter_id,
                    entry.version, name)
        return name

    async def follow(self, entry: CatalogEntry | None, adapter_id: str) -> None:
        """Drop what the catalog no longer keeps of `adapter_id` (None: the id is gone):
        engine copies (their requests end) and disk copies. The caller holds the id's lock."""
        keep = {e.version for e in entry.kept} if entry is not None else set()
        for name in [n for n in self.in_engine if parse_pin(n)[0] == adapter_id]:
            if parse_pin(name)[1].version not in keep:
                self.in_engine.discard(name)
                await self.engine.remove_adapter(name)
        if self.store is not None:
            await asyncio.to_thread(self.store.kept.prune, adapter_id, keep)


def _stored(entry: CatalogEntry) -> StoredAdapter:
    """What the kept copy of a fetched version records (its meta.json)."""
    return StoredAdapter(entry.adapter_id, entry.version, entry.sha256, entry.num_bytes,
                         entry.source, entry.revision, entry.rank, tuple(entry.targets),
                         entry.created_at, config_sha256=entry.config_sha256,
                         object_key=entry.object_key, owner=entry.owner, base=entry.base)
