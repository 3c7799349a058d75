"""The residency registry: which adapters exist fleet-wide, and which replica holds which.

One interface (``Registry``, adapters.registry_types), two implementations:
``InProcessRegistry`` (adapters.registry_inprocess: the default, a single replica, no Redis) and
``RedisRegistry`` (adapters.registry_redis: ``--redis-url``); ``make_registry`` picks one. The
nouns are re-exported here, so callers import everything registry-shaped from this module.
The residency manager writes the catalog and this replica's state; the router reads
``replicas()``; every replica subscribes to "added" / "deleted" / "replaced" events to keep its
view of the catalog current.
Events a replica causes reach its own subscribers too; filter on ``event.origin`` if needed.

Registry calls never raise because Redis is away: reads fall back to what is known locally,
writes are replayed when Redis returns, and ``healthy`` says which mode is in force.
"""

from __future__ import annotations

from loragw.adapters.registry_inprocess import InProcessRegistry
from loragw.adapters.registry_types import (
    EVENT_ADDED,
    EVENT_DELETED,
    EVENT_REPLACED,
    AdapterEvent,
    CatalogEntry,
    EventCallback,
    Registry,
    ReplicaState,
    decode_state,
)

__all__ = [
    "EVENT_ADDED", "EVENT_DELETED", "EVENT_REPLACED", "AdapterEvent", "CatalogEntry", "EventCallback",
    "InProcessRegistry", "REGISTRY_PREFIX", "Registry", "ReplicaState", "decode_state",
    "make_registry",
]  # fmt: skip

REGISTRY_PREFIX = "loragw:"  # the gateway keys its catalog by base model under this


def make_registry(
    redis_url: str | None,
    replica_id: str,
    *,
    heartbeat_s: float = 2.0,
    ttl_s: float = 6.0,
    prefix: str = REGISTRY_PREFIX,
) -> Registry:
    """``RedisRegistry`` when ``redis_url`` is set, else ``InProcessRegistry``.

    ``heartbeat_s``, ``ttl_s`` and ``prefix`` only matter with Redis. Call ``await start()``.
    """
    if not redis_url:
        return InProcessRegistry(replica_id)
    from loragw.adapters.registry_redis import RedisRegistry

    return RedisRegistry(redis_url, replica_id, heartbeat_s=heartbeat_s, ttl_s=ttl_s, prefix=prefix)
