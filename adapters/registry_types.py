"""The registry's nouns, its interface and their wire format, shared by both implementations.

``CatalogEntry`` (filled by the residency manager when an adapter is registered),
``ReplicaState`` (filled by the residency manager, stamped on every publish) and
``AdapterEvent`` (made by a registry when a catalog write adds, deletes or replaces weights).
``Registry`` is the interface gateway code holds; adapters.registry picks the implementation.
Redis stores the same dataclasses as msgspec JSON (the decoders at the bottom).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar, runtime_checkable

import msgspec

from loragw.adapters.base_identity import BaseIdentity
from loragw.adapters.chat_files import AdapterChat

logger = logging.getLogger(__name__)

EVENT_ADDED = "added"
EVENT_DELETED = "deleted"
EVENT_REPLACED = "replaced"
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    """One registered adapter, fleet-wide: the catalog is the fleet's truth. ``version`` grows
    each time the id gets new weights. Where a replica gets the bytes: the shared object store
    (``object_key``), else its source (the Hub, S3, a path every replica may mount), else
    nowhere: only ``holder`` has them (an upload, or a path, without a shared store)."""

    adapter_id: str
    source: str  # local dir, hf://ORG/REPO[@REV], s3://BUCKET/PATH/, or "upload"
    revision: str | None
    sha256: str  # of adapter_model.safetensors
    rank: int
    targets: tuple[str, ...]  # target modules, e.g. ("q_proj", "v_proj")
    num_bytes: int
    version: int
    config_sha256: str = ""  # of adapter_config.json
    object_key: str = ""  # the pair's key in the shared object store; "" when not there
    holder: str = ""  # the replica that registered it, when no other may be able to fetch it
    created_at: float = 0.0  # unix time of this version's registration
    owner: str = ""  # the tenant it belongs to; "": shared with every key (DESIGN.md, Tenants)
    base: BaseIdentity | None = None  # the base model it was made for (adapters.base_identity)
    draft_source: str = ""  # its draft-model LoRA's source, applied on every replica (if any)
    chat: AdapterChat = AdapterChat()  # its own chat template, parsers, sampling defaults
    # the earlier versions still kept (--adapter-versions-kept), newest first, each with kept=()
    kept: tuple[CatalogEntry, ...] = ()

    def same_weights(self, other: CatalogEntry) -> bool:
        return (self.sha256, self.config_sha256, self.version) == (
            other.sha256, other.config_sha256, other.version)


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """What one replica advertises to the router. Filled by the residency manager."""

    replica_id: str
    url: str  # --advertise-url: where other replicas forward requests
    resident: tuple[str, ...]  # adapter ids in device slots
    loading: tuple[str, ...]  # adapter ids being loaded into a slot
    free_slots: int
    queue_depth: int  # waiting requests
    updated_at: float  # time.time() of the last publish (heartbeats refresh it)
    # adapter ids it holds in host memory or on disk, not in a slot (host first, a bounded
    # number): who can serve an adapter while the store it comes from is down. Absent from an
    # older replica's state: it holds nothing we know of.
    held: tuple[str, ...] = ()
    # (adapter id, tokens/s, requests/s) it served over the last minute, its busiest first
    # (gateway/residency/demand.py): what the fleet's placement plan is computed from
    demand: tuple[tuple[str, float, float], ...] = ()
    # What the placement plan sizes it by (gateway/fleet/placement.py): the ids of `held` in
    # host memory (the rest are on disk only), the tokens/s it carries at full load (0: not
    # known yet), its device slot memory for adapters, and one LoRA rank's share of that memory
    host: tuple[str, ...] = ()
    tokens_per_s: float = 0.0
    slot_bytes: int = 0
    rank_bytes: int = 0


@dataclass(frozen=True, slots=True)
class AdapterEvent:
    """Broadcast when an adapter id is added, deleted or gets new weights."""

    kind: str  # EVENT_ADDED | EVENT_DELETED | EVENT_REPLACED
    adapter_id: str
    version: int  # the new version (replaced) or the version that was removed (deleted)
    origin: str  # replica_id that caused it; "" when found by a resync after an outage


EventCallback = Callable[[AdapterEvent], Awaitable[None] | None]


@runtime_checkable
class Registry(Protocol):
    replica_id: str

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def put_adapter(self, entry: CatalogEntry) -> None: ...
    async def get_adapter(self, adapter_id: str) -> CatalogEntry | None: ...
    async def list_adapters(self) -> list[CatalogEntry]: ...
    async def delete_adapter(self, adapter_id: str) -> bool: ...
    async def publish_state(self, state: ReplicaState) -> None: ...
    async def replicas(self) -> list[ReplicaState]: ...
    def subscribe(self, callback: EventCallback) -> None: ...

    @property
    def healthy(self) -> bool: ...


def stamp(state: ReplicaState) -> ReplicaState:
    """The state with ``updated_at`` set to now: what a publish or heartbeat stores."""
    return replace(state, updated_at=time.time())


async def deliver(callbacks: list[EventCallback], event: AdapterEvent) -> None:
    """Run every subscriber on ``event`` in order; one failing subscriber does not stop the rest."""
    for callback in list(callbacks):
        try:
            result = callback(event)
            if inspect.isawaitable(result):
                await result
        except Exception:
            logger.exception("registry subscriber %r failed on %s", callback, event)


def catalog_changes(before: dict[str, CatalogEntry], after: dict[str, CatalogEntry]):
    """Adds, deletes and replacements between two catalog snapshots, as events of unknown
    origin."""
    for adapter_id, old in before.items():
        new = after.get(adapter_id)
        if new is None:
            yield AdapterEvent(EVENT_DELETED, adapter_id, old.version, origin="")
        elif not new.same_weights(old):
            yield AdapterEvent(EVENT_REPLACED, adapter_id, new.version, origin="")
    for adapter_id, new in after.items():
        if adapter_id not in before:
            yield AdapterEvent(EVENT_ADDED, adapter_id, new.version, origin="")


# Wire format: the same dataclasses, as msgspec JSON.
_encoder = msgspec.json.Encoder()
encode = _encoder.encode
decode_entry = msgspec.json.Decoder(CatalogEntry).decode
decode_state = msgspec.json.Decoder(ReplicaState).decode
decode_event = msgspec.json.Decoder(AdapterEvent).decode


def decode_all(decode: Callable[[bytes], T], payloads: Iterable[bytes]) -> list[T]:
    """Decode each payload, skipping (with a warning) any written by an incompatible version."""
    out = []
    for raw in payloads:
        try:
            out.append(decode(raw))
        except msgspec.DecodeError as exc:
            logger.warning("registry: ignoring a malformed record %r: %s", raw[:200], exc)
    return out
