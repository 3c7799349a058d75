"""This replica's side of the fleet's heartbeats: the ReplicaState it publishes (what it holds,
bounded), and what the live replicas' states say about one adapter: who holds it in a device
slot (`resident_on`), and who holds its bytes at all (`holders`: a slot, host memory or disk).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from loragw.adapters.registry import ReplicaState
from loragw.adapters.types import EMBED_TOKENS, EXPERT_TARGETS, LM_HEAD, ROUTER, BaseModelSpec
from loragw.engine.api import EngineSnapshot
from loragw.gateway.common.records import AdapterRecord
from loragw.gateway.residency.demand import PUBLISHED, DemandWindow, published

# Adapter ids a heartbeat lists as held beyond its slots: at most 128 characters each, so a
# state stays under ~32 KB however many adapters its disk keeps; host copies go first.
HELD_PUBLISHED = 256
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def replica_state(replica_id: str, url: str, snap: EngineSnapshot,
                  records: Mapping[str, AdapterRecord], loading: Iterable[str],
                  demand: DemandWindow | None = None,
                  spec: BaseModelSpec | None = None) -> ReplicaState:
    """What this replica publishes now: its slots, loads, free slots, queue, the adapters it
    holds in host memory or on disk (from the snapshot and its records: no I/O), the demand it
    served, its busiest adapters', and what placement sizes it by (tokens/s at full load, slot
    memory and one rank's share of it). Each call is one look of the full-load rate."""
    host = sorted(name for name, tier in snap.residency.items() if tier == "host")
    disk = sorted(name for name, record in records.items() if record.stored is not None
                  and snap.residency.get(name, "disk") == "disk")
    per_rank = rank_bytes(spec) if spec is not None else 0
    slot_bytes = per_rank * spec.max_lora_rank * snap.slots_total if spec is not None else 0
    return ReplicaState(replica_id, url, tuple(snap.resident), tuple(sorted(loading)),
                        snap.free_slots, snap.num_waiting, 0.0,  # the registry stamps it
                        held=tuple((host + disk)[:HELD_PUBLISHED]),
                        demand=published(demand.rates(top=PUBLISHED)) if demand else (),
                        host=tuple(host[:HELD_PUBLISHED]),
                        tokens_per_s=demand.full_load.observe(
                            demand.total_tokens, snap.num_waiting > 0) if demand else 0.0,
                        slot_bytes=slot_bytes, rank_bytes=per_rank)


def rank_bytes(spec: BaseModelSpec) -> int:
    """Device bytes one LoRA rank takes in a projections slot: (in + out) of every projection of
    every decoder layer, in the served dtype (engine/lora/pool.py's per-slot size over R),
    known before the pool is allocated by the first adapter."""
    skip = {EMBED_TOKENS, LM_HEAD, *EXPERT_TARGETS, ROUTER}
    elements = sum(i + o for target, (o, i) in spec.module_shapes.items() if target not in skip)
    return spec.num_layers * elements * DTYPE_BYTES.get(spec.dtype, 4)


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
