"""One replica at a time computes the fleet's placement plan (gateway/fleet/placement.py),
under a lease in Redis; every replica holds the plan it last computed or read.

    {prefix}placement:lease   the planning replica's id, PX LEASE_MS, renewed on each tick
    {prefix}placement         the last plan (PlanRecord JSON): assignments, load, moves,
                              the demand it came from, who computed it and when

Each replica ticks with its heartbeat: the lease holder, or whoever finds the lease lapsed (a
dead planner's successor, within LEASE_MS), computes the plan from what the replicas published
and writes it; the others read it. With Redis away every replica keeps its last plan; without
Redis (one replica) it plans for itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from loragw.gateway.fleet.placement import (
    DEFAULT_SETTINGS,
    EMPTY_PLAN,
    Plan,
    PlanSettings,
    ReplicaCapacity,
    plan,
)
from loragw.gateway.residency.demand import Demand

logger = logging.getLogger(__name__)

LEASE_MS = 1500  # three ticks (gateway/fleet/placing.py): a dead planner is replaced within
# one registry heartbeat of its last renewal (a closing one gives the lease up at once)
REDIS_TIMEOUT_S = 1.0
REDIS_ERRORS = (RedisError, OSError)

# Take the lease if it is free or ours (then renew it): 1 if we hold it now.
_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class PlanRecord(msgspec.Struct, frozen=True):
    """A plan as Redis keeps it and GET /admin/placement shows it."""

    assignments: dict[str, list[str]]
    load: dict[str, float]
    moves: int
    unplaced: list[str]
    demand: dict[str, tuple[float, float]]  # adapter -> (tokens/s, requests/s)
    leader: str
    computed_at: float  # time.time()

    def plan(self) -> Plan:
        return Plan({a: tuple(rs) for a, rs in self.assignments.items()}, self.moves,
                    dict(self.load), tuple(self.unplaced))


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(PlanRecord).decode


class Planner:
    def __init__(self, redis_url: str | None, prefix: str, replica_id: str,
                 settings: PlanSettings = DEFAULT_SETTINGS):
        self.replica_id, self.settings = replica_id, settings
        self.redis = (Redis.from_url(redis_url, socket_timeout=REDIS_TIMEOUT_S,
                                     socket_connect_timeout=REDIS_TIMEOUT_S)
                      if redis_url else None)
        self.key, self.lease_key = f"{prefix}placement", f"{prefix}placement:lease"
        self._lease = self.redis.register_script(_LEASE) if self.redis else None
        self._release = self.redis.register_script(_RELEASE) if self.redis else None
        self.record: PlanRecord | None = None  # the plan this replica holds now, as stored
        self.plan: Plan = EMPTY_PLAN  # the same, as the router and the next plan read it
        self.leader = False
        self._away = False

    def _hold(self, record: PlanRecord) -> None:
        self.record, self.plan = record, record.plan()

    async def tick(self, demand: Mapping[str, Demand], replicas: Sequence[ReplicaCapacity],
                   sizes: Mapping[str, int]) -> PlanRecord | None:
        """Plan (as the lease holder) or read the plan; the plan held afterwards."""
        if self.redis is None:
            self.leader = True
            self._hold(self._compute(demand, replicas, sizes))
            return self.record
        try:
            self.leader = bool(await self._lease(keys=[self.lease_key],
                                                 args=[self.replica_id, LEASE_MS]))
            if self.leader:
                self._hold(self._compute(demand, replicas, sizes))
                await self.redis.set(self.key, _encode(self.record))
            else:
                raw = await self.redis.get(self.key)
                if raw is not None:
                    self._hold(_decode(raw))
        except REDIS_ERRORS as exc:
            if not self._away:
                logger.warning("placement: Redis does not answer (%s); keeping the last plan",
                               exc)
            self._away, self.leader = True, False
            return self.record
        except msgspec.DecodeError:
            logger.warning("placement: the stored plan does not decode; keeping the last one")
        self._away = False
        return self.record

    def _compute(self, demand: Mapping[str, Demand], replicas: Sequence[ReplicaCapacity],
                 sizes: Mapping[str, int]) -> PlanRecord:
        made = plan(demand, replicas, sizes, self.plan, self.settings)
        return PlanRecord({a: list(rs) for a, rs in made.assignments.items()}, made.load,
                          made.moves, list(made.unplaced),
                          {a: (d.tokens_per_s, d.requests_per_s) for a, d in demand.items()},
                          self.replica_id, time.time())

    async def close(self) -> None:
        if self.redis is not None:
            if self.leader:
                try:
                    await self._release(keys=[self.lease_key], args=[self.replica_id])
                except REDIS_ERRORS:
                    pass  # it lapses within LEASE_MS
            await self.redis.aclose()
