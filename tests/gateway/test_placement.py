"""The placement plan (gateway/fleet/placement.py) as a pure function: copies by demand with
hysteresis, packing by slot memory, holders first, a stable plan, the move cap, and a balanced
fleet under Zipf demand; and the demand it is computed from (gateway/fleet/demand.py)."""

from __future__ import annotations

import asyncio
import math
import random
import time

import pytest
from fleet_harness import redis_fixture

from loragw.adapters.registry import ReplicaState
from loragw.adapters.types import BaseModelSpec
from loragw.gateway.fleet.placement import (
    PlanSettings,
    ReplicaCapacity,
    copies_needed,
    plan,
)
from loragw.gateway.fleet.placing import capacities
from loragw.gateway.fleet.planner import LEASE_MS, Planner
from loragw.gateway.fleet.router import choose, score
from loragw.gateway.residency.demand import (
    Demand,
    DemandWindow,
    FullLoadRate,
    fleet_demand,
    published,
)
from loragw.gateway.residency.heartbeat import rank_bytes

MB = 1 << 20
SETTINGS = PlanSettings(target_utilization=0.5, hysteresis=0.25, max_moves=100_000)
PER_COPY = 1000 * SETTINGS.target_utilization  # tokens/s one copy is planned to carry


def fleet(n: int, slot_mb: int = 64, held: dict[str, dict[str, str]] | None = None):
    return [ReplicaCapacity(f"r{i}", 1000.0, slot_mb * MB, (held or {}).get(f"r{i}", {}))
            for i in range(n)]


def zipf(n: int, s: float, total: float, seed: int = 0) -> dict[str, Demand]:
    weights = [1 / (i + 1) ** s for i in range(n)]
    names = [f"a{i}" for i in range(n)]
    random.Random(seed).shuffle(names)
    return {name: Demand(total * w / sum(weights)) for name, w in zip(names, weights, strict=True)}


@pytest.mark.parametrize("need, previous, copies", [
    (0.2, 0, 1), (1.0, 0, 1), (1.01, 0, 2), (2.5, 0, 3), (2.5, 1, 3),
    (1.9, 3, 3),  # the two left would be 95% busy: keep three
    (1.4, 3, 2), (0.8, 2, 2), (0.74, 2, 1), (9.0, 0, 4)])  # four replicas at most
def test_copies_follow_demand_with_hysteresis(need, previous, copies):
    assert copies_needed(Demand(need * PER_COPY), PER_COPY, 4, previous, 0.25) == copies


def test_a_hot_adapter_gets_three_copies_and_loses_them_when_it_cools():
    demand = {"hot": Demand(2.5 * PER_COPY), "cold": Demand(0.1 * PER_COPY)}
    sizes = {"hot": 8 * MB, "cold": 8 * MB}
    first = plan(demand, fleet(4), sizes, settings=SETTINGS)
    assert first.copies("hot") == 3 and first.copies("cold") == 1
    assert len(set(first.assignments["hot"])) == 3
    steady = plan(demand, fleet(4), sizes, first, SETTINGS)
    assert steady.assignments == first.assignments and steady.moves == 0
    cooled = plan({**demand, "hot": Demand(0.3 * PER_COPY)}, fleet(4), sizes, steady, SETTINGS)
    assert cooled.assignments["hot"] == first.assignments["hot"][:1]  # a copy it had stays
    assert cooled.moves == 0


def test_packing_is_by_slot_memory_not_by_count():
    # each replica has 64 MB of slots: one rank-64 adapter (64 MB) or eight rank-8 ones
    sizes = {"big": 64 * MB} | {f"s{i}": 8 * MB for i in range(8)}
    demand = {name: Demand(0.05 * PER_COPY) for name in sizes}
    demand["big"] = Demand(0.5 * PER_COPY)
    placed = plan(demand, fleet(2), sizes, settings=SETTINGS)
    assert not placed.unplaced
    used = {r: sum(sizes[a] for a, rs in placed.assignments.items() if r in rs) for r in ("r0", "r1")}
    assert max(used.values()) <= 64 * MB
    big = placed.assignments["big"][0]
    assert all(big not in placed.assignments[f"s{i}"] for i in range(8))
    # a colder rank-64 adapter finds no room: left to be placed on first use
    crowded = plan({**demand, "big2": Demand(0.01 * PER_COPY)}, fleet(2), sizes | {"big2": 64 * MB},
                   settings=SETTINGS)
    assert crowded.unplaced == ("big2",)


def test_a_new_copy_goes_where_the_adapter_already_is():
    held = {"r2": {"a": "disk"}, "r3": {"a": "host"}}
    placed = plan({"a": Demand(0.2 * PER_COPY)}, fleet(4, held=held), {"a": 8 * MB},
                  settings=SETTINGS)
    assert placed.assignments["a"] == ("r3",)  # host beats disk beats nothing


def test_moves_per_plan_are_capped_and_the_rest_keep_their_copies():
    sizes = {f"a{i}": 8 * MB for i in range(40)}
    before = plan({a: Demand(0.1 * PER_COPY) for a in sizes}, fleet(8), sizes,
                  settings=SETTINGS)
    burst = {a: Demand(1.8 * PER_COPY) for a in sizes}  # every adapter wants a second copy
    capped = plan(burst, fleet(8), sizes, before, PlanSettings(0.5, 0.25, max_moves=5))
    assert capped.moves == 5
    assert sum(capped.copies(a) for a in sizes) == len(sizes) + 5
    assert all(set(before.assignments[a]) <= set(capped.assignments[a]) for a in sizes)


@pytest.mark.parametrize("replicas, adapters, s", [(8, 1000, 0.8), (8, 1000, 1.2),
                                                   (32, 10_000, 1.0)])
def test_zipf_demand_is_balanced_across_the_fleet(replicas, adapters, s):
    demand = zipf(adapters, s, total=0.6 * 1000 * replicas)
    sizes = {a: 8 * MB for a in demand}
    placed = plan(demand, fleet(replicas, slot_mb=8 * 2 * adapters // replicas), sizes,
                  settings=SETTINGS)
    assert not placed.unplaced
    loads = list(placed.load.values())
    assert max(loads) / (sum(loads) / len(loads)) <= 1.3, sorted(loads)[-3:]
    hottest = max(demand, key=lambda a: demand[a].tokens_per_s)
    assert placed.copies(hottest) == math.ceil(demand[hottest].tokens_per_s / PER_COPY)
    again = plan(demand, fleet(replicas, slot_mb=8 * 2 * adapters // replicas), sizes,
                 settings=SETTINGS)
    assert again.assignments == placed.assignments  # every planner computes the same plan


# ---- demand: the window each replica keeps, summed over the fleet ---------------------------
def test_a_window_counts_requests_and_tokens_and_forgets_old_buckets():
    window = DemandWindow(window_s=60, bucket_s=5)
    for t in range(0, 60, 2):  # one 100-token request every 2 s for a minute
        window.record("bot", 100, now=1000.0 + t)
    window.record("other", 30, now=1059.0)
    rates = window.rates(now=1059.5)
    # the window's rate, or the last two buckets' when that is higher: 5 requests in 9.5 s
    assert rates["bot"] == Demand(max(30 * 100 / 60, 500 / 9.5), max(30 / 60, 5 / 9.5))
    assert list(window.rates(now=1059.5, top=1)) == ["bot"]
    later = window.rates(now=1090.0)  # the first 30 s have aged out
    assert 0 < later["bot"].tokens_per_s < rates["bot"].tokens_per_s
    assert window.rates(now=1200.0) == {}


def test_a_rise_shows_within_two_buckets_and_a_fall_fades_over_the_window():
    window = DemandWindow(window_s=60, bucket_s=5)
    for t in range(50):  # quiet: one 10-token request a second
        window.record("bot", 10, now=1000.0 + t)
    quiet = window.rates(now=1050.0)["bot"].tokens_per_s
    for k in range(100):  # a burst: 1,000 tokens/s for 10 s
        window.record("bot", 100, now=1050.0 + k / 10)
    burst = window.rates(now=1060.0)["bot"].tokens_per_s
    assert quiet == pytest.approx(10.0) and burst == pytest.approx(1000.0)  # at once
    # 30 s on, the burst is the window's: its 10,000 tokens and 15 s of the quiet, over 60 s
    assert window.rates(now=1090.0)["bot"].tokens_per_s == pytest.approx((10_000 + 150) / 60)
    assert window.rates(now=1125.0) == {}


def test_the_fleet_demand_sums_what_each_replica_serves():
    def state(rid: str, rates: dict[str, Demand]) -> ReplicaState:
        return ReplicaState(rid, "", (), (), 0, 0, 0.0, demand=published(rates))

    one = state("r1", {"bot": Demand(10.0, 0.5), "x": Demand(1.0, 0.1)})
    two = state("r2", {"bot": Demand(5.0, 0.25)})
    assert fleet_demand([one, two]) == {"bot": Demand(15.0, 0.75), "x": Demand(1.0, 0.1)}


def test_a_replica_publishes_the_demand_it_served(server, http):
    """Requests served here are counted as they end and published in the heartbeat."""
    for _ in range(3):
        r = http.post("/v1/completions", json={"model": "lora-3", "prompt": "hi",
                                                "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
    adapters = server.services.adapters
    asyncio.run_coroutine_threadsafe(adapters.publish(), server.services.loop).result(30)
    (state,) = asyncio.run_coroutine_threadsafe(adapters.registry.replicas(),
                                                server.services.loop).result(30)
    demand = fleet_demand([state])
    usage = r.json()["usage"]
    assert demand["lora-3"].requests_per_s >= 3 / 60
    assert demand["lora-3"].tokens_per_s >= 3 * usage["total_tokens"] / 60


# ---- the planner: one replica plans under a lease in Redis, the others read ----------------
@pytest.fixture
def redis_url(tmp_path):
    server = redis_fixture.RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()


def test_one_replica_plans_and_the_others_read_it_and_a_successor_takes_over(redis_url):
    demand = {"hot": Demand(2.5 * PER_COPY), "cold": Demand(0.1 * PER_COPY)}
    sizes = {"hot": 8 * MB, "cold": 8 * MB}

    async def run():
        first, second = (Planner(redis_url.url, "t:", rid, SETTINGS) for rid in ("r1", "r2"))
        planned = await first.tick(demand, fleet(4), sizes)
        read = await second.tick({}, [], {})  # a follower does not plan: it reads
        assert first.leader and not second.leader
        assert read == planned and second.plan.copies("hot") == 3
        assert planned.leader == "r1" and planned.demand["hot"][0] == demand["hot"].tokens_per_s
        # the planner stops ticking (it died): its lease lapses and the next tick takes over
        await asyncio.sleep(LEASE_MS / 1000 + 0.2)
        taken = await second.tick(demand, fleet(4), sizes)
        assert second.leader and taken.leader == "r2"
        assert taken.assignments == planned.assignments  # the plan it inherited stays
        redis_url.kill()  # Redis away: both keep what they hold
        assert await second.tick(demand, fleet(4), sizes) == taken and not second.leader
        assert (await first.tick(demand, fleet(4), sizes)).assignments == planned.assignments
        for p in (first, second):
            await p.close()

    asyncio.run(run())


def test_a_closing_planner_hands_the_lease_over_at_once(redis_url):
    async def run():
        first, second = (Planner(redis_url.url, "t:", rid, SETTINGS) for rid in ("r1", "r2"))
        await first.tick({}, fleet(2), {})
        await second.tick({}, fleet(2), {})
        assert first.leader and not second.leader
        await first.close()  # a scale-down: no waiting for the lease to lapse
        await second.tick({}, fleet(2), {})
        assert second.leader
        await second.close()

    asyncio.run(run())


# ---- what a replica publishes for placement, and how the plan's copies are routed -----------
def test_full_load_rate_is_measured_only_while_saturated_unless_configured():
    rate = FullLoadRate()
    assert rate.observe(0, saturated=True, now=0.0) == 0.0  # the first look: no interval yet
    assert rate.observe(500, saturated=False, now=1.0) == 0.0  # idle: says nothing of the peak
    assert rate.observe(1500, saturated=True, now=2.0) == 1000.0
    assert rate.observe(2100, saturated=True, now=3.0) == pytest.approx(0.3 * 600 + 0.7 * 1000)
    assert FullLoadRate(250.0).observe(10_000, saturated=True, now=1.0) == 250.0


def test_rank_bytes_count_every_projection_of_every_layer():
    spec = BaseModelSpec(num_layers=2, module_shapes={
        "q_proj": (64, 64), "v_proj": (32, 64), "embed_tokens": (64, 1000),
        "lm_head": (1000, 64)}, max_lora_rank=8, dtype="bfloat16")
    assert rank_bytes(spec) == 2 * ((64 + 64) + (32 + 64)) * 2  # no vocabulary ends


def test_capacities_fill_in_unknown_rates_and_name_what_each_replica_holds():
    def state(rid, rate, **held):
        return ReplicaState(rid, f"http://{rid}", held.get("resident", ()), (), 0, 0, 0.0,
                            held=held.get("held", ()), host=held.get("host", ()),
                            tokens_per_s=rate, slot_bytes=MB)

    known = capacities([state("a", 100.0, resident=("x",)), state("b", 0.0, held=("y", "z"),
                                                                    host=("y",))])
    assert [c.tokens_per_s for c in known] == [100.0, 100.0]  # the mean of the known ones
    assert known[0].held == {"x": "device"} and known[1].held == {"y": "host", "z": "disk"}
    unknown = capacities([state("a", 0.0), state("b", 0.0)])
    assert all(math.isinf(c.tokens_per_s) for c in unknown)
    # unknown rates: one copy each, whatever the demand
    made = plan({"hot": Demand(1e6)}, unknown, {"hot": 1})
    assert made.copies("hot") == 1


def _state(rid: str, resident=(), host=(), held=(), free_slots=1, queue_depth=0) -> ReplicaState:
    return ReplicaState(rid, f"http://{rid}", tuple(resident), (), free_slots, queue_depth, 0.0,
                        held=tuple(held), host=tuple(host))


def test_tiers_order_the_scores():
    scores = [score(_state("x", resident=["a"]), "a"), score(_state("x", host=["a"], held=["a"]),
              "a"), score(_state("x", held=["a"]), "a"), score(_state("x"), "a"),
              score(_state("x", free_slots=0), "a")]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == 5


def test_a_planned_adapter_spreads_over_its_copies_and_a_user_stays_on_one():
    states = [_state("r1", resident=["a"]), _state("r2", host=["a"], held=["a"]),
              _state("r3", resident=["a"]), _state("r4", resident=["a"])]
    copies = ("r1", "r2", "r3")  # r4 holds it too, but the plan does not send it there
    rng = random.Random(0)
    picked = [choose(states, "r1", "a", copies, rng=rng) for _ in range(300)]
    counts = {rid: sum((p.replica_id if p else "r1") == rid for p in picked) for rid in copies}
    assert all(60 < n < 140 for n in counts.values()), counts
    for user in ("alice", "bob", "carol"):
        assert len({getattr(choose(states, "r1", "a", copies, user), "replica_id", "r1")
                    for _ in range(20)}) == 1
    users = {getattr(choose(states, "r1", "a", copies, f"u{i}"), "replica_id", "r1")
             for i in range(60)}
    assert users == set(copies)
    # a copy whose queue runs deep is left out until it drains
    deep = [*states[:2], _state("r3", resident=["a"], queue_depth=10), states[3]]
    assert all(getattr(choose(deep, "r1", "a", copies, rng=rng), "replica_id", "r1") != "r3"
               for _ in range(100))


def test_one_replica_plans_for_itself_and_shows_it(server, http):
    for _ in range(2):
        assert http.post("/v1/completions", json={"model": "lora-2", "prompt": "hi",
                                                   "max_tokens": 2}).status_code == 200
    adapters = server.services.adapters
    asyncio.run_coroutine_threadsafe(adapters.publish(), server.services.loop).result(30)

    def shown() -> dict:
        r = http.get("/admin/placement")
        assert r.status_code == 200, r.text
        return r.json()

    deadline = time.monotonic() + 10
    while not any(row["adapter"] == "lora-2" for row in shown()["adapters"]):
        assert time.monotonic() < deadline, shown()
        time.sleep(0.1)
    view = shown()
    assert view["object"] == "placement" and view["leader"]  # no Redis: it plans for itself
    row = next(row for row in view["adapters"] if row["adapter"] == "lora-2")
    assert row["replicas"] == [view["replica"]] and row["requests_per_s"] > 0
