"""How the fleet's catalog and the admin API see one adapter: its CatalogEntry (registry) and
its AdapterInfo (GET /admin/adapters), both from its stored copy and the engine's state."""

from __future__ import annotations

import msgspec

from adapters.registry import CatalogEntry
from adapters.store_meta import StoredAdapter
from engine.snapshot import EngineSnapshot
from gateway.residency.tiers import AdapterRecord


class AdapterInfo(msgspec.Struct):
    """One adapter as the admin API shows it."""

    id: str
    version: int  # the store's version: +1 on every replace
    sha256: str
    rank: int
    targets: list[str]
    bytes: int
    source: str
    residency: str  # "device" | "host" | "disk"
    pinned: bool
    created: int



def catalog_entry(stored: StoredAdapter) -> CatalogEntry:
    return CatalogEntry(stored.adapter_id, stored.source, stored.revision, stored.sha256,
                        stored.rank, tuple(stored.targets), stored.num_bytes, stored.version)


def adapter_info(record: AdapterRecord, snapshot: EngineSnapshot) -> AdapterInfo:
    s = record.stored
    residency = snapshot.residency.get(s.adapter_id, "disk")
    pinned = s.adapter_id in snapshot.pinned if s.adapter_id in snapshot.residency else record.pinned
    return AdapterInfo(s.adapter_id, s.version, s.sha256, s.rank, list(s.targets), s.num_bytes,
                       s.source, residency, pinned, int(s.created_at))
