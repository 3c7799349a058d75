"""The fleet's placement plan: how many copies each adapter gets, and on which replicas.

One pure function, `plan`, from what the fleet knows to where adapters should live:

    demand    per adapter, tokens/s and requests/s over a sliding window
    replicas  per replica, the tokens/s it can carry, the slot memory it has (bytes), and the
              adapters it holds now, by tier (device, host, disk)
    sizes     per adapter, the slot memory one copy takes (rank x modules x 2 x hidden x dtype)
    previous  the last plan: its assignments are kept where they still fit (hysteresis)

Copies. An adapter's need is its token rate over what one replica carries at
`target_utilization`; it gets ceil(need) copies, 1 to every replica. A copy goes only when the
copies left would be no busier than `1 - hysteresis` of their share, so demand that hovers at
a boundary does not flip a copy on and off each interval.

Packing, hottest adapter first. A copy stays where the previous plan put it, if that replica
still has the memory; a new copy goes where it costs least: among replicas that stay under
target with it, one that holds the adapter (device, then host, then disk), then the one with
the most load headroom, ties broken by rendezvous hash so every planner picks the same. Room is
slot memory, not a count: a rank-64 adapter takes what eight rank-8 ones do. A new (adapter,
replica) pair is a move unless that replica has the adapter in memory already; at most
`max_moves` per plan, so a burst cannot reshuffle the fleet at once: what does not get its
move keeps the previous plan's copies.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from loragw.gateway.residency.demand import Demand

TIER_ORDER = ("device", "host", "disk")  # cheapest first: where a new copy costs least
WARM = ("device", "host")  # a copy planned where it already is in memory moves nothing


@dataclass(frozen=True, slots=True)
class ReplicaCapacity:
    replica_id: str
    tokens_per_s: float  # what it serves at full load (measured step times, or configured)
    slot_bytes: int  # device slot memory for adapters
    held: Mapping[str, str] = field(default_factory=dict)  # adapter -> tier it holds it in


@dataclass(frozen=True, slots=True)
class PlanSettings:
    target_utilization: float = 0.7  # a copy is planned for this share of a replica's tokens/s
    hysteresis: float = 0.25  # drop a copy only when the rest would be this much under target
    max_moves: int = 16  # new (adapter, replica) pairs per plan


@dataclass(frozen=True, slots=True)
class Plan:
    assignments: dict[str, tuple[str, ...]]  # adapter -> its replicas, best first
    moves: int  # (adapter, replica) pairs new in this plan
    load: dict[str, float]  # replica -> the tokens/s the plan sends it
    unplaced: tuple[str, ...] = ()  # adapters with demand that no replica had room for

    def copies(self, adapter: str) -> int:
        return len(self.assignments.get(adapter, ()))


EMPTY_PLAN = Plan({}, 0, {})
DEFAULT_SETTINGS = PlanSettings()


def copies_needed(demand: Demand, per_copy: float, replicas: int, previous: int,
                  hysteresis: float) -> int:
    """How many copies `demand` needs, each carrying `per_copy` tokens/s: ceil(need) when that
    is more than `previous`, else `previous` until the copies left would be idle enough."""
    need = demand.tokens_per_s / per_copy if per_copy > 0 else float(replicas)
    wanted = max(1, math.ceil(need - 1e-9))
    k = previous
    if wanted > k:
        k = wanted
    while k > 1 and need <= (k - 1) * (1.0 - hysteresis):
        k -= 1
    return max(1, min(k, replicas))


def rendezvous(adapter: str, replica: str) -> int:
    """A stable pseudo-random rank of `replica` for `adapter`, the same on every planner."""
    return int.from_bytes(hashlib.blake2b(f"{adapter}\0{replica}".encode(), digest_size=8)
                          .digest(), "big")


def plan(demand: Mapping[str, Demand], replicas: Sequence[ReplicaCapacity],
         sizes: Mapping[str, int], previous: Plan = EMPTY_PLAN,
         settings: PlanSettings = DEFAULT_SETTINGS) -> Plan:
    """The placement for `demand` on `replicas` (see the module doc). Adapters without a size
    (not in the catalog) or without demand are left out: the router places them on first use."""
    by_id = {r.replica_id: r for r in replicas}
    if not by_id:
        return EMPTY_PLAN
    mean_capacity = sum(r.tokens_per_s for r in replicas) / len(replicas)
    per_copy = mean_capacity * settings.target_utilization
    free = {r.replica_id: r.slot_bytes for r in replicas}
    load = {r.replica_id: 0.0 for r in replicas}
    assignments: dict[str, tuple[str, ...]] = {}
    unplaced: list[str] = []
    moves = 0
    hottest = sorted((a for a, d in demand.items() if a in sizes and d.tokens_per_s > 0),
                     key=lambda a: (-demand[a].tokens_per_s, a))
    for adapter in hottest:
        size, rate = sizes[adapter], demand[adapter].tokens_per_s
        before = [r for r in previous.assignments.get(adapter, ()) if r in by_id]
        k = copies_needed(demand[adapter], per_copy, len(by_id), len(before),
                          settings.hysteresis)
        chosen: list[str] = []
        for r in before:  # kept where they still fit
            if len(chosen) < k and free[r] >= size:
                chosen.append(r)
                free[r] -= size
        while len(chosen) < k and moves < settings.max_moves:
            best = _cheapest(adapter, size, rate / k, chosen, by_id, free, load,
                             settings.target_utilization)
            if best is None:
                break
            chosen.append(best)
            free[best] -= size
            moves += best not in before and by_id[best].held.get(adapter) not in WARM
        if not chosen:
            unplaced.append(adapter)
            continue
        for r in chosen:
            load[r] += rate / len(chosen)
        assignments[adapter] = tuple(chosen)
    return Plan(assignments, moves, load, tuple(unplaced))


def _cheapest(adapter: str, size: int, share: float, chosen: list[str],
              by_id: Mapping[str, ReplicaCapacity], free: Mapping[str, int],
              load: Mapping[str, float], target: float) -> str | None:
    """Where a new copy of `adapter` (carrying `share` tokens/s) costs least: among replicas
    that stay under target with it, one that holds it (device, host, disk), then the most load
    headroom; None when no replica has the memory."""
    fits = [r for r in by_id if r not in chosen and free[r] >= size]
    if not fits:
        return None

    def cost(r: str) -> tuple:
        capacity = by_id[r].tokens_per_s
        over = load[r] + share > capacity * target
        tier = by_id[r].held.get(adapter)
        held = TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER)
        return (over, held, load[r] - capacity, rendezvous(adapter, r))

    return min(fits, key=cost)
