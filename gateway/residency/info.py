"""How the fleet's catalog and the admin API see one adapter: its CatalogEntry (registry), made
from the copy a replica stored, and its AdapterInfo (GET /admin/adapters), from the catalog's
entry, this replica's tiers and the fleet's heartbeats."""

from __future__ import annotations

import msgspec

from loragw.adapters.chat_files import AdapterChat
from loragw.adapters.registry import CatalogEntry
from loragw.adapters.store_meta import StoredAdapter
from loragw.engine.api import EngineSnapshot
from loragw.gateway.common.records import AdapterRecord, Location


class AdapterInfo(msgspec.Struct):
    """One adapter as the admin API shows it."""

    id: str
    version: int  # the catalog's version: +1 on every replace, on any replica
    sha256: str  # of adapter_model.safetensors
    rank: int
    targets: list[str]
    bytes: int
    source: str
    residency: str  # on this replica: "device" | "host" | "disk" | "remote"
    pinned: bool
    created: int
    resident_on: list[str] = []  # replicas holding it in a device slot
    object_key: str = ""  # in the shared object store ("": not there)
    holder: str = ""  # the only replica with its bytes, when it is not in a shared store
    warnings: list[str] = []  # accepted, but worth a look (e.g. trained on another base)
    owner: str = ""  # the tenant it belongs to ("": shared with every key)
    base: str = ""  # the base model it was made for: "NAME (ARCHITECTURE, base KEY)"
    versions: list[int] = []  # the versions a request may pin (ID@N), newest first
    draft_adapter: str = ""  # the source of its draft-model LoRA (speculative decoding)
    # its own chat, where it does not speak as the base: a template, parser names, sampling
    chat_template: bool = False  # it brings its own chat template
    reasoning_parser: str = ""  # its own ("": the base's)
    tool_call_parser: str = ""
    generation_config: bool = False  # it brings its own generation_config.json


def catalog_entry(stored: StoredAdapter, holder: str) -> CatalogEntry:
    return CatalogEntry(stored.adapter_id, stored.source, stored.revision, stored.sha256,
                        stored.rank, tuple(stored.targets), stored.num_bytes, stored.version,
                        stored.config_sha256, stored.object_key, holder, stored.created_at,
                        stored.owner, stored.base, stored.draft_source, chat=stored.chat)


def adapter_info(record: AdapterRecord, residency: str, snapshot: EngineSnapshot,
                 resident_on: list[str]) -> AdapterInfo:
    e = record.entry
    pinned = e.adapter_id in snapshot.pinned if e.adapter_id in snapshot.residency else record.pinned
    warnings = list(record.stored.warnings) if record.stored is not None else []
    return AdapterInfo(e.adapter_id, e.version, e.sha256, e.rank, list(e.targets), e.num_bytes,
                       e.source, residency, pinned, int(e.created_at), sorted(resident_on),
                       e.object_key, e.holder, warnings, e.owner,
                       e.base.describe() if e.base is not None else "",
                       [e.version, *(k.version for k in e.kept)], e.draft_source,
                       bool(e.chat.template), e.chat.reasoning_parser, e.chat.tool_call_parser,
                       bool(e.chat.generation_config))


def chat_of(records: dict[str, AdapterRecord], location: Location) -> AdapterChat | None:
    """The chat of the version `location` names (None: the base model's)."""
    record = records.get(location.adapter_id) if location.adapter_id else None
    if record is None:
        return None
    entry = record.entry
    if location.older:  # a pinned earlier version speaks as it did
        entry = next((k for k in entry.kept if k.version == location.version), entry)
    return entry.chat


def residency(record: AdapterRecord | None, name: str, snapshot: EngineSnapshot | None) -> str:
    """"device" | "host" | "disk" on this replica, or "remote" (not fetched here yet)."""
    if record is not None and record.stored is None:
        return "remote"
    return snapshot.residency.get(name, "disk") if snapshot is not None else "disk"
