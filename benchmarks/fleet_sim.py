"""A discrete-event fleet simulator: this fleet's placement against the anchors' policies.

    python benchmarks/fleet_sim.py [--replicas 8] [--adapters 1000] [--zipf 1.0] [--requests 20000]
    python benchmarks/fleet_sim.py --needed --replicas 8 --adapters 10000   # replicas for a p99

It drives the real code: gateway/fleet/placement.py's `plan` (every --plan-s, from the demand
each replica counted in gateway/residency/demand.py's DemandWindow, summed by `fleet_demand`),
gateway/fleet/placing.py's `capacities`, and gateway/fleet/router.py's `choose` with each
replica's ReplicaState. No model runs: a replica is `--slots` device slots (LRU among slots no
running request uses) and `--host-slots` adapters in host memory (LRU); a request's adapter
costs a slot fill (--fill-ms) if it is in host memory, a store fetch first (--fetch-ms) if not;
decode runs `--output-tokens` steps of step_ms(batch) = --step-ms + --row-ms x batch. Requests
arrive Poisson at --load x what the fleet can carry, spread round-robin over the replicas (a
Kubernetes Service); popularity is Zipf(--zipf) and reshuffles at half time.

Policies, as their docs describe them:
    round-robin      serve where the request lands
    rendezvous       every adapter on its highest-random-weight replica (Dynamo's proposal)
    llm-d            lora-affinity: a replica running or holding the adapter in a slot, else one
                     with a free slot, less queue (no host or disk tier in its view)
    aibrix           one pod per adapter (the one with fewest adapters, at first use), every
                     pod for an adapter over 1/replicas of recent traffic; least queue among them
    ray-lru          multiplexed: a replica holding it in one of --slots models (LRU), else two
                     random replicas, the shorter queue
    placement        this fleet: the plan's copies, tier- and queue-aware routing, prefetch
The static oracle knows each half's popularity and pins the fleet's slot count of the most
popular adapters: the requests for the rest are loads no policy avoids (the loads floor).
Default timings are this repository's measurements (benchmarks/RESULTS.md: store -> host
550 ms for a 6.6 MB adapter, host -> slot 0.3 ms/MB plus the first prefill, a 2 ms hop).
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import itertools
import random
import statistics
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from loragw.adapters.registry import ReplicaState
from loragw.gateway.fleet.placement import EMPTY_PLAN, PlanSettings, plan
from loragw.gateway.fleet.placing import capacities
from loragw.gateway.fleet.router import choose
from loragw.gateway.residency.demand import DemandWindow, fleet_demand, published

POLICIES = ("round-robin", "rendezvous", "llm-d", "aibrix", "ray-lru", "placement")


@dataclass(slots=True)
class Slot:
    adapter: str | None = None
    refs: int = 0
    ready_at: float = 0.0  # ms: when its fill finishes
    last_used: float = 0.0


@dataclass
class Replica:
    name: str
    slots: list[Slot]
    host_slots: int
    window_s: float
    host: OrderedDict = field(default_factory=OrderedDict)  # adapter -> ready time (ms)
    waiting: deque = field(default_factory=deque)
    running: int = 0
    tokens: int = 0
    demand: DemandWindow = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.demand = DemandWindow(self.window_s)

    def to_host(self, adapter: str, at: float) -> None:
        self.host[adapter] = at
        self.host.move_to_end(adapter)
        while len(self.host) > self.host_slots:
            self.host.popitem(last=False)

    def state(self, now: float, tiers: bool, capacity: float, top: int = 256) -> ReplicaState:
        ready = tuple(s.adapter for s in self.slots if s.adapter and s.ready_at <= now)
        loading = tuple(s.adapter for s in self.slots if s.adapter and s.ready_at > now)
        host = tuple(a for a, at in self.host.items() if at <= now) if tiers else ()
        return ReplicaState(self.name, f"sim://{self.name}", ready, loading,
                            sum(s.adapter is None for s in self.slots), len(self.waiting), now,
                            held=host, host=host, tokens_per_s=capacity,
                            slot_bytes=len(self.slots) + self.host_slots, rank_bytes=1,
                            demand=published(self.demand.rates(now / 1000, top)) if top else ())


def hrw(adapter: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{adapter}/{replica}".encode(), digest_size=8)
                          .digest(), "big")


def simulate(policy: str, a, seed: int, replicas_n: int) -> dict:
    rng = random.Random(seed)
    names = [f"ad{i}" for i in range(a.adapters)]
    weights = [1.0 / (i + 1) ** a.zipf for i in range(a.adapters)]
    shuffled = names[:]
    random.Random(seed + 1000).shuffle(shuffled)  # the popularity after the shift
    reps = [Replica(f"r{i}", [Slot() for _ in range(a.slots)], a.host_slots, a.plan_window_s)
            for i in range(replicas_n)]
    by_name = {r.name: r for r in reps}
    step = a.step_ms + a.row_ms * a.max_num_seqs  # a full batch's step
    capacity = a.max_num_seqs * (a.prompt_tokens + a.output_tokens) / (
        (a.output_tokens * step + a.prefill_ms) / 1000)  # tokens/s at full load
    rate = a.load * capacity * replicas_n / (a.prompt_tokens + a.output_tokens)  # req/s
    events, seq = [], itertools.count()
    t, half = 0.0, a.requests // 2
    popular = {}
    for rid in range(a.requests):
        t += rng.expovariate(rate / 1000)
        ranked = names if rid < half else shuffled
        adapter = rng.choices(ranked, weights)[0]
        popular.setdefault(rid >= half, []).append(adapter)
        heapq.heappush(events, (t, next(seq), "arrive", (rid, adapter, reps[rid % replicas_n])))
    heapq.heappush(events, (0.0, next(seq), "plan", None))
    current, loads, fetches, forwards, ttft = EMPTY_PLAN, 0, 0, 0, []
    aibrix: dict[str, list[str]] = {}
    settings = PlanSettings()
    recent: deque = deque(maxlen=2000)

    def start(rep: Replica, now: float) -> None:
        nonlocal loads, fetches
        for req in list(rep.waiting):
            if rep.running >= a.max_num_seqs:
                return
            rid, adapter, arrival, hop = req
            slot = next((s for s in rep.slots if s.adapter == adapter), None)
            if slot is None:
                idle = [s for s in rep.slots if s.refs == 0]
                if not idle:
                    continue
                slot = min(idle, key=lambda s: (s.adapter is not None, s.last_used))
                at = rep.host.get(adapter)  # in host memory from `at` (a prefetch may run)
                if at is None:
                    fetches += 1
                    at = now + a.fetch_ms
                loads += 1
                slot.adapter, slot.ready_at = adapter, max(now, at) + a.fill_ms
            rep.to_host(adapter, rep.host.get(adapter, slot.ready_at))  # a use keeps it warm
            rep.waiting.remove(req)
            slot.refs += 1
            slot.last_used = now
            rep.running += 1
            first = max(now, slot.ready_at) + a.prefill_ms + hop
            ttft.append(first - arrival)
            service = a.output_tokens * (a.step_ms + a.row_ms * rep.running)
            heapq.heappush(events, (first + service, next(seq), "finish", (rep, slot, adapter)))

    def route(entry: Replica, adapter: str, now: float) -> Replica:
        if policy == "round-robin":
            return entry
        if policy == "rendezvous":
            return max(reps, key=lambda r: hrw(adapter, r.name))
        if policy == "ray-lru":
            holding = [r for r in reps if any(s.adapter == adapter for s in r.slots)]
            pool = holding or rng.sample(reps, min(2, len(reps)))
            return min(rng.sample(pool, min(2, len(pool))), key=lambda r: len(r.waiting))
        if policy == "aibrix":
            share = recent.count(adapter) / max(len(recent), 1)
            if share > 1 / len(reps):
                pods = reps
            else:
                if adapter not in aibrix:
                    counts = {r.name: 0 for r in reps}
                    for placed in aibrix.values():
                        counts[placed[0]] += 1
                    aibrix[adapter] = [min(counts, key=counts.get)]
                pods = [by_name[n] for n in aibrix[adapter]]
            return min(pods, key=lambda r: (len(r.waiting) + r.running, r.name))
        states = [r.state(now, policy == "placement", capacity, top=0) for r in reps]
        copies = current.assignments.get(adapter, ()) if policy == "placement" else ()
        target = choose(states, entry.name, adapter, copies, None, rng)
        return by_name[target.replica_id] if target is not None else entry

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            rid, adapter, entry = payload
            recent.append(adapter)
            rep = route(entry, adapter, now)
            hop = a.forward_ms if rep is not entry else 0.0
            forwards += rep is not entry
            rep.waiting.append((rid, adapter, now, hop))
            start(rep, now)
        elif kind == "finish":
            rep, slot, adapter = payload
            slot.refs -= 1
            rep.running -= 1
            rep.tokens += a.prompt_tokens + a.output_tokens
            rep.demand.record(adapter, a.prompt_tokens + a.output_tokens, now / 1000)
            start(rep, now)
        elif policy == "placement" and events:  # plan: the real planner, then prefetch
            states = [r.state(now, True, capacity) for r in reps]
            demand = fleet_demand(states)
            made = plan(demand, capacities(states), {x: 1 for x in demand}, current, settings)
            for adapter, where in made.assignments.items():
                for name in where:
                    if name not in current.assignments.get(adapter, ()) and \
                            adapter not in by_name[name].host:
                        by_name[name].to_host(adapter, now + a.fetch_ms)
                        fetches += 1
            current = made
            heapq.heappush(events, (now + a.plan_s * 1000, next(seq), "plan", None))
    ttft.sort()
    tokens = [r.tokens for r in reps]
    floor = sum(oracle_floor(popular[h], a.slots * replicas_n) for h in popular)
    return {"loads": 1000 * loads / a.requests, "fetches": 1000 * fetches / a.requests,
            "floor": 1000 * floor / a.requests, "forwarded": 100 * forwards / a.requests,
            "p50": ttft[len(ttft) // 2], "p99": ttft[int(0.99 * (len(ttft) - 1))],
            "imbalance": max(tokens) / statistics.fmean(tokens)}


def oracle_floor(requests: list[str], fleet_slots: int) -> int:
    """Loads a static placement that knows the popularity cannot avoid: the requests for the
    adapters outside the `fleet_slots` most requested."""
    tally: dict[str, int] = {}
    for x in requests:
        tally[x] = tally.get(x, 0) + 1
    return sum(sorted(tally.values(), reverse=True)[fleet_slots:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--adapters", type=int, default=1000)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--load", type=float, default=0.6, help="arrivals / fleet capacity")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--host-slots", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--output-tokens", type=int, default=100)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--row-ms", type=float, default=0.5)
    p.add_argument("--prefill-ms", type=float, default=40.0)
    p.add_argument("--fill-ms", type=float, default=50.0)
    p.add_argument("--fetch-ms", type=float, default=550.0)
    p.add_argument("--forward-ms", type=float, default=2.0)
    p.add_argument("--plan-s", type=float, default=1.0)
    p.add_argument("--plan-window-s", type=float, default=10.0)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--needed", action="store_true", help="replicas each policy needs for "
                   "--target-p99-ms at the load sized for --replicas")
    p.add_argument("--target-p99-ms", type=float, default=1000.0)
    a = p.parse_args(argv)
    policies = a.policies.split(",")
    print(f"`python benchmarks/fleet_sim.py {' '.join(argv or sys.argv[1:])}`".replace(" `", "`"))
    print(f"\n{a.replicas} replicas x {a.slots} slots + {a.host_slots} host, {a.adapters} "
          f"adapters, Zipf({a.zipf}) reshuffled at half time, {a.requests} requests at "
          f"{a.load:.0%} of capacity, mean of {a.seeds} seeds\n")
    if a.needed:
        print(f"| policy | replicas for p99 TTFT < {a.target_p99_ms:g} ms |\n|---|---|")
        for policy in policies:
            n = a.replicas
            while n <= 4 * a.replicas:
                runs = [simulate(policy, argparse.Namespace(**{**vars(a), "load": a.load *
                        a.replicas / n}), s, n) for s in range(a.seeds)]
                if statistics.fmean(r["p99"] for r in runs) < a.target_p99_ms:
                    break
                n += max(1, a.replicas // 4)
            shown = n if n <= 4 * a.replicas else f"> {4 * a.replicas}"
            print(f"| {policy} | {shown} |")
        return 0
    print("| policy | loads / 1000 req | store fetches / 1000 | forwarded | p50 TTFT | p99 TTFT "
          "| imbalance |\n|---|---|---|---|---|---|---|")
    floor = None
    for policy in policies:
        runs = [simulate(policy, a, s, a.replicas) for s in range(a.seeds)]
        r = {k: statistics.fmean(x[k] for x in runs) for k in runs[0]}
        floor = r["floor"]
        print(f"| {policy} | {r['loads']:.0f} | {r['fetches']:.0f} | {r['forwarded']:.0f}% | "
              f"{r['p50']:.0f} ms | {r['p99']:.0f} ms | {r['imbalance']:.2f} |")
    print(f"\nstatic oracle: {floor:.0f} loads / 1000 requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
