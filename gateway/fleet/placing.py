"""This replica's part in fleet placement. Every TICK_S it ticks the planner (the lease, then
plan or read: gateway/fleet/planner.py) with what the replicas' heartbeats say, and makes its
own share of the plan true:

    newly assigned here            fetched and parsed into host memory ahead of its requests,
                                   and into a slot if one is free or idle, unless it is in
                                   memory already (PREFETCH_PER_TICK at a time: a new plan's
                                   burst does not starve the requests in flight; once: an
                                   operator's evict afterwards stands)
    assigned elsewhere, no longer  let go from memory, down to disk, unless a request runs on
    here                           it or it is pinned (the engine refuses those: tried again
                                   on the next tick while the plan still says so)

Adapters the plan does not name (never, or no longer: no demand left) are the engine's LRU's
to keep or evict, as before. The router (gateway/fleet/router.py) asks `copies` to send each
request to one of its adapter's copies; GET /admin/placement (gateway/admin/placement.py)
shows the plan held; loragw_adapter_copies and loragw_placement_moves_total export it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Iterable

from loragw.adapters.registry import ReplicaState
from loragw.gateway.common.errors import APIError
from loragw.gateway.fleet.placement import Plan, ReplicaCapacity
from loragw.gateway.fleet.planner import Planner, PlanRecord
from loragw.gateway.observe.metrics import Metrics
from loragw.gateway.residency.demand import fleet_demand
from loragw.gateway.residency.manager import AdapterManager

logger = logging.getLogger(__name__)

TICK_S = 0.5  # the lease is renewed (and the plan recomputed) this often
PREFETCH_PER_TICK = 2
IN_MEMORY = ("device", "host")


def capacities(states: Iterable[ReplicaState]) -> list[ReplicaCapacity]:
    """The replicas as the planner sizes them. One whose full-load rate is not known yet is
    taken to carry the mean of the known ones; with none known, every replica carries any
    demand (math.inf): each adapter gets one copy until a replica has been saturated once."""
    states = list(states)
    known = [s.tokens_per_s for s in states if s.tokens_per_s > 0]
    default = sum(known) / len(known) if known else math.inf
    return [ReplicaCapacity(s.replica_id, s.tokens_per_s or default, s.slot_bytes,
                            {**dict.fromkeys(s.held, "disk"), **dict.fromkeys(s.host, "host"),
                             **dict.fromkeys(s.resident, "device")})
            for s in states if s.url or len(states) == 1]


class Placement:
    def __init__(self, manager: AdapterManager, metrics: Metrics, redis_url: str | None):
        self.manager, self.metrics = manager, metrics
        self.replica_id = manager.replica_id
        self.planner = Planner(redis_url, manager.registry_prefix, self.replica_id)
        self._task: asyncio.Task | None = None
        self._mine: set[str] = set()  # what the plan assigned here at the last tick
        self._copies: set[str] = set()  # adapters with a copies series exported
        self._prefetching: set[str] = set()
        self._pending: set[str] = set()  # newly assigned here, not prefetched yet
        self._tasks: set[asyncio.Task] = set()  # prefetches in flight

    def copies(self, adapter: str) -> tuple[str, ...]:
        """The replicas the plan held now assigns `adapter` (the router's question)."""
        return self.planner.plan.assignments.get(adapter, ())

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        for task in [self._task, *self._tasks]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.planner.close()  # gives the lease up: the next planner takes over at once

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self.tick()
            except Exception:  # the engine stopping, say: the next tick tries again
                logger.exception("placement tick failed")

    async def tick(self) -> PlanRecord | None:
        states = await self.manager.registry.replicas()
        records = self.manager.records
        demand = {a: d for a, d in fleet_demand(states).items() if a in records}
        rank_bytes = max((s.rank_bytes for s in states), default=0) or 1
        sizes = {a: records[a].entry.rank * rank_bytes for a in demand}
        record = await self.planner.tick(demand, capacities(states), sizes)
        if record is None:
            return None
        if self.planner.leader:  # it computed this plan now
            self.metrics.placement_moves.inc(record.moves)
        self._export(record)
        await self._apply(self.planner.plan)
        return record

    def _export(self, record: PlanRecord) -> None:
        """Copies of the busiest --metrics-max-adapters adapters: the label set stays bounded."""
        busiest = sorted(record.assignments, key=lambda a: -record.demand.get(a, (0.0, 0.0))[0])
        shown = set(busiest[:self.metrics.labels.max_adapters])
        for adapter in self._copies - shown:
            self.metrics.adapter_copies.remove(adapter)
        for adapter in shown:
            self.metrics.adapter_copies.labels(adapter).set(len(record.assignments[adapter]))
        self._copies = shown

    async def _apply(self, plan: Plan) -> None:
        records = self.manager.records
        mine = {a for a, rs in plan.assignments.items() if self.replica_id in rs and a in records}
        tiers = (await self.manager.engine.snapshot()).residency
        self._pending = (self._pending | (mine - self._mine)) & mine
        cold = sorted(a for a in self._pending if a not in self.manager.tiers.loading
                      and a not in self._prefetching)
        for adapter in cold[:PREFETCH_PER_TICK]:
            self._pending.discard(adapter)
            if tiers.get(adapter, "disk") in IN_MEMORY:
                continue
            self._prefetching.add(adapter)
            task = asyncio.create_task(self._prefetch(adapter, records[adapter].in_engine))
            self._tasks.add(task)  # held: the loop keeps only weak references to tasks
            task.add_done_callback(self._tasks.discard)
        for adapter in sorted(self._mine - mine):
            record = records.get(adapter)
            if (adapter not in plan.assignments  # no demand left: the engine's LRU decides
                    or record is None or tiers.get(adapter) not in IN_MEMORY or record.pinned):
                continue
            try:
                await self.manager.tiers.evict(adapter)
                logger.info("placement: %s let go here (the plan moved it)", adapter)
            except APIError:  # a request runs on it: the next tick tries again
                mine.add(adapter)
        self._mine = mine

    async def _prefetch(self, adapter: str, in_engine: bool) -> None:
        """Fetched and parsed (new here), or read back from disk (evicted before): into host
        memory, and into a device slot when one is free or holds an idle adapter."""
        try:
            if not in_engine:
                await self.manager.ensure_in_engine(adapter)
            await self.manager.tiers.to_device(adapter)
            logger.info("placement: %s prefetched", adapter)
        except Exception as exc:  # the store down, say: its first request tries again
            logger.warning("placement: prefetch of %s failed: %s", adapter, exc)
        finally:
            self._prefetching.discard(adapter)
