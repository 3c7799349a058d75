"""GET /admin/placement: the fleet's placement plan as this replica holds it, and the demand it
was computed from (gateway/fleet/placing.py). A tenant's admin key sees the adapters it may
use; the replicas' planned loads are the operator's to see.

    GET /admin/placement -> 200 PlacementView
"""

from __future__ import annotations

import msgspec
from litestar import Controller, Request, get

from loragw.gateway.fleet.placing import Placement
from loragw.gateway.http.auth import principal, require_admin_key
from loragw.gateway.http.error_handlers import error_responses
from loragw.gateway.http.strict_body import strict_body
from loragw.gateway.residency.manager import AdapterManager


class AdapterPlacement(msgspec.Struct):
    adapter: str
    replicas: list[str]  # the plan's copies, best first
    tokens_per_s: float  # the fleet's demand for it, over --demand-window-s
    requests_per_s: float


class PlacementView(msgspec.Struct):
    replica: str  # the replica that answered
    leader: bool  # whether it computes the plan (holds the lease)
    computed_by: str | None  # the replica that computed the plan held (None: no plan yet)
    computed_at: float | None  # unix seconds
    moves: int  # (adapter, replica) pairs new in this plan
    adapters: list[AdapterPlacement]  # busiest first
    unplaced: list[str]  # adapters with demand no replica had room for
    load_tokens_per_s: dict[str, float] | None  # replica -> what the plan sends it (operator)
    object: str = "placement"


class PlacementController(Controller):
    path = "/admin/placement"
    guards = [require_admin_key]
    before_request = strict_body
    tags = ["Admin"]

    @get("/", responses=error_responses(401, 403, 503))
    async def get_placement(self, request: Request, placement: Placement,
                            adapters: AdapterManager) -> PlacementView:
        caller, record, records = principal(request), placement.planner.record, adapters.records

        def visible(adapter: str) -> bool:
            entry = records.get(adapter)
            return entry is not None and caller.may_use(adapter, entry.entry.owner)

        if record is None:
            return PlacementView(placement.replica_id, placement.planner.leader, None, None, 0,
                                 [], [], {} if caller.operator else None)
        rows = [AdapterPlacement(a, rs, *record.demand.get(a, (0.0, 0.0)))
                for a, rs in record.assignments.items() if visible(a)]
        rows.sort(key=lambda row: (-row.tokens_per_s, row.adapter))
        return PlacementView(placement.replica_id, placement.planner.leader, record.leader,
                             record.computed_at, record.moves, rows,
                             [a for a in record.unplaced if visible(a)],
                             dict(record.load) if caller.operator else None)
