"""This replica's side of the fleet's heartbeats: the ReplicaState it publishes (what it holds,
bounded), and what the live replicas' states say about one adapter: who holds it in a device
slot (`resident_on`), and who holds its bytes at all (`holders`: a slot, host memory or disk).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from loragw.adapters.registry import ReplicaState
from loragw.engine.api import EngineSnapshot
from loragw.gateway.common.records import AdapterRecord
from loragw.gateway.residency.demand import PUBLISHED, DemandWindow, published

# Adapter ids a heartbeat lists as held beyond its slots: at most 128 characters each, so a
# state stays under ~32 KB however many adapters its disk keeps; host copies go first.
HELD_PUBLISHED = 256


def replica_state(replica_id: str, url: str, snap: EngineSnapshot,
                  records: Mapping[str, AdapterRecord], loading: Iterable[str],
                  demand: DemandWindow | None = None) -> ReplicaState:
    """What this replica publishes now: its slots, loads, free slots, queue, the adapters it
    holds in host memory or on disk (from the snapshot and its records: no I/O), and the
    demand it served, its busiest adapters'."""
    host = sorted(name for name, tier in snap.residency.items() if tier == "host")
    disk = sorted(name for name, record in records.items() if record.stored is not None
                  and snap.residency.get(name, "disk") == "disk")
    return ReplicaState(replica_id, url, tuple(snap.resident), tuple(sorted(loading)),
                        snap.free_slots, snap.num_waiting, 0.0,  # the registry stamps it
                        held=tuple((host + disk)[:HELD_PUBLISHED]),
                        demand=published(demand.rates(top=PUBLISHED)) if demand else ())


def resident_on(states: Iterable[ReplicaState]) -> dict[str, list[str]]:
    """adapter id -> the replicas that hold it in a device slot."""
    where: dict[str, list[str]] = defaultdict(list)
    for state in states:
        for adapter_id in state.resident:
            where[adapter_id].append(state.replica_id)
    return where


def holders(states: Iterable[ReplicaState], adapter_id: str, self_id: str) -> tuple[str, ...]:
    """The other live replicas that hold `adapter_id`'s bytes: in a slot, host memory or disk."""
    return tuple(s.replica_id for s in states if s.replica_id != self_id
                 and (adapter_id in s.resident or adapter_id in s.held))
