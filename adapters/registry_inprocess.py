"""InProcessRegistry: the registry of a single replica (the default, no ``--redis-url``)."""

from __future__ import annotations

from loragw.adapters.registry_types import (
    EVENT_ADDED,
    EVENT_DELETED,
    EVENT_REPLACED,
    AdapterEvent,
    CatalogEntry,
    EventCallback,
    ReplicaState,
    deliver,
    stamp,
)


class InProcessRegistry:
    """The single-replica registry: plain dicts, events handed straight to subscribers."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self._catalog: dict[str, CatalogEntry] = {}
        self._state: ReplicaState | None = None
        self._callbacks: list[EventCallback] = []

    @property
    def healthy(self) -> bool:
        return True

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def put_adapter(self, entry: CatalogEntry) -> None:
        old = self._catalog.get(entry.adapter_id)
        self._catalog[entry.adapter_id] = entry
        if old is None or not old.same_weights(entry):
            kind = EVENT_ADDED if old is None else EVENT_REPLACED
            event = AdapterEvent(kind, entry.adapter_id, entry.version, self.replica_id)
            await deliver(self._callbacks, event)

    async def get_adapter(self, adapter_id: str) -> CatalogEntry | None:
        return self._catalog.get(adapter_id)

    async def list_adapters(self) -> list[CatalogEntry]:
        return sorted(self._catalog.values(), key=lambda e: e.adapter_id)

    async def delete_adapter(self, adapter_id: str) -> bool:
        old = self._catalog.pop(adapter_id, None)
        if old is None:
            return False
        event = AdapterEvent(EVENT_DELETED, adapter_id, old.version, self.replica_id)
        await deliver(self._callbacks, event)
        return True

    async def publish_state(self, state: ReplicaState) -> None:
        assert state.replica_id == self.replica_id, (state.replica_id, self.replica_id)
        self._state = stamp(state)

    async def replicas(self) -> list[ReplicaState]:
        return [self._state] if self._state is not None else []

    def subscribe(self, callback: EventCallback) -> None:
        self._callbacks.append(callback)
