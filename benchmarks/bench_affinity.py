"""Adapter-affinity routing vs round-robin on a simulated fleet, driving the real router.

    python benchmarks/bench_affinity.py [--requests 3000] [--zipf 1.0] [--load-ms 500] ...
    python benchmarks/bench_affinity.py --slots 8 --adapters 100 --uploads --fetch-ms 550 \
        --load-ms 50 --host-slots 16       # the realistic fleet: uploads through any replica

Three replicas, `--slots` device slots each (LRU among slots no running request uses),
`--adapters` adapters with zipf popularity, Poisson arrivals spread round-robin over the
replicas (what a Kubernetes Service does). "round-robin" serves each request where it lands;
"affinity" asks `gateway.fleet.router.choose` with each replica's live state (resident,
loading, free slots, queue depth) and forwards when it says so. With `--uploads`, adapter i
is uploaded at a random time in the first `--upload-window` of the run through a random
replica (which then holds it in host memory; every replica can fetch it from the shared
store), and requests only name adapters uploaded by then. With `--host-slots`, a replica keeps
that many adapters in host memory (LRU): a device load of one it holds costs `--load-ms`, of
one it must first fetch from the store `--fetch-ms` more. A discrete-event simulation: no model
runs, so the result depends only on the named assumptions below, which the table prints.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import logging
import random
import statistics
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its neighbours, from anywhere

from loragw.adapters.registry import ReplicaState  # noqa: E402
from loragw.gateway.fleet.router import choose  # noqa: E402

logger = logging.getLogger("bench_affinity")

# Assumptions (flags override them).
RESIDENT_TTFT_MS = 40.0  # SGLang's measured median TTFT with adapters resident (FACTS.md)
LOAD_MS = 500.0  # one cold adapter load into a device slot (disk/host -> device)
FETCH_MS = 0.0  # object store -> disk -> host, before a load, of an adapter not in host memory
FORWARD_MS = 2.0  # one extra HTTP hop inside the cluster
SERVICE_MS = 1000.0  # a request's decode time after its first token
MAX_NUM_SEQS = 8  # requests a replica runs at once
RATE_RPS = 6.0  # fleet arrival rate: a quarter of 3 x 8 / 1 s lane capacity


@dataclass(slots=True)
class Slot:
    adapter: str | None = None
    refs: int = 0  # running requests using it: never evicted while > 0
    ready_at: float = 0.0  # when its load finishes (loading until then)
    last_used: float = 0.0


@dataclass(slots=True)
class Request:
    rid: int
    adapter: str
    arrival: float
    extra_ms: float = 0.0  # forwarding hop
    first_token: float = 0.0


@dataclass
class Replica:
    name: str
    slots: list[Slot]
    host_slots: int = 0  # adapters kept in host memory (LRU); 0: every adapter, always
    running: int = 0
    waiting: deque = field(default_factory=deque)
    host: OrderedDict = field(default_factory=OrderedDict)  # adapter -> None, LRU order

    def hold(self, adapter: str) -> bool:
        """Put `adapter` in host memory; whether it had to be fetched (it was not there)."""
        if not self.host_slots:
            return False
        fetched = adapter not in self.host
        self.host[adapter] = None
        self.host.move_to_end(adapter)
        while len(self.host) > self.host_slots:
            self.host.popitem(last=False)
        return fetched

    def state(self, now: float) -> ReplicaState:
        ready = tuple(s.adapter for s in self.slots if s.adapter and s.ready_at <= now)
        loading = tuple(s.adapter for s in self.slots if s.adapter and s.ready_at > now)
        free = sum(s.adapter is None for s in self.slots)
        return ReplicaState(self.name, f"sim://{self.name}", ready, loading, free,
                            len(self.waiting), now)

    def slot_for(self, adapter: str) -> tuple[Slot | None, bool]:
        """(slot, cold): the slot holding `adapter`, else an LRU slot no one uses to load it."""
        for s in self.slots:
            if s.adapter == adapter:
                return s, False
        idle = [s for s in self.slots if s.refs == 0]
        if not idle:
            return None, False
        return min(idle, key=lambda s: (s.adapter is not None, s.last_used)), True


def simulate(policy: str, args, seed: int) -> dict:
    rng = random.Random(seed)
    names = [f"adapter-{i}" for i in range(args.adapters)]
    weights = [1.0 / (i + 1) ** args.zipf for i in range(args.adapters)]
    replicas = [Replica(f"r{i}", [Slot() for _ in range(args.slots)], args.host_slots)
                for i in range(3)]
    by_name = {r.name: r for r in replicas}
    events: list = []  # (time_ms, seq, kind, payload)
    seq = itertools.count()
    now, loads, fetches, forwards, done = 0.0, 0, 0, 0, []

    duration = args.requests / (args.rate / 1000.0)
    uploaded_at = {n: 0.0 for n in names}
    if args.uploads:  # each through a random replica, which then holds it in host memory
        for name in names:
            uploaded_at[name] = rng.uniform(0.0, args.upload_window * duration)
        for name in sorted(names, key=uploaded_at.get):
            rng.choice(replicas).hold(name)
    t = 0.0
    for rid in range(args.requests):
        t += rng.expovariate(args.rate / 1000.0)
        ready = [(n, w) for n, w in zip(names, weights) if uploaded_at[n] <= t] or [
            min(zip(names, weights), key=lambda nw: uploaded_at[nw[0]])]
        req = Request(rid, rng.choices([n for n, _ in ready], [w for _, w in ready])[0], t)
        heapq.heappush(events, (t, next(seq), "arrive", (req, replicas[rid % 3])))

    def try_start(rep: Replica) -> None:
        nonlocal loads, fetches
        for req in list(rep.waiting):  # FIFO, skipping requests whose adapter has no slot yet
            if rep.running >= args.max_num_seqs:
                return
            slot, cold = rep.slot_for(req.adapter)
            if slot is None:
                continue
            rep.waiting.remove(req)
            if cold:
                loads += 1
                fetched = rep.hold(req.adapter)
                fetches += fetched
                slot.adapter = req.adapter
                slot.ready_at = now + args.load_ms + (args.fetch_ms if fetched else 0.0)
            else:
                rep.hold(req.adapter)  # a use keeps its host copy warm
            slot.refs += 1
            slot.last_used = now
            rep.running += 1
            req.first_token = max(now, slot.ready_at) + args.resident_ms + req.extra_ms
            heapq.heappush(events, (req.first_token + args.service_ms, next(seq), "finish",
                                    (req, rep, slot)))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            req, rep = payload
            if policy == "affinity":
                target = choose([r.state(now) for r in replicas], rep.name, req.adapter)
                if target is not None:
                    rep, req.extra_ms = by_name[target.replica_id], args.forward_ms
                    forwards += 1
            rep.waiting.append(req)
            try_start(rep)
        else:
            req, rep, slot = payload
            slot.refs -= 1
            rep.running -= 1
            done.append(req.first_token - req.arrival)
            try_start(rep)
    done.sort()
    return {"loads_per_1000": 1000.0 * loads / args.requests,
            "fetches_per_1000": 1000.0 * fetches / args.requests,
            "forwarded_pct": 100.0 * forwards / args.requests,
            "ttft_mean_ms": statistics.fmean(done), "ttft_p50_ms": done[len(done) // 2],
            "ttft_p99_ms": done[int(0.99 * (len(done) - 1))]}


def placement_floor(args) -> float:
    """The share of requests whose adapter is outside the fleet's slot count of most popular
    adapters: even a perfect static placement loads at least this often."""
    weights = [1.0 / (i + 1) ** args.zipf for i in range(args.adapters)]
    return sum(weights[3 * args.slots:]) / sum(weights)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--adapters", type=int, default=30)
    p.add_argument("--slots", type=int, default=3, help="device slots per replica")
    p.add_argument("--zipf", type=float, default=1.0, help="popularity exponent s: p_i ~ i^-s")
    p.add_argument("--rate", type=float, default=RATE_RPS, help="fleet arrivals per second")
    p.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS)
    p.add_argument("--resident-ms", type=float, default=RESIDENT_TTFT_MS)
    p.add_argument("--load-ms", type=float, default=LOAD_MS)
    p.add_argument("--fetch-ms", type=float, default=FETCH_MS)
    p.add_argument("--host-slots", type=int, default=0,
                   help="adapters a replica holds in host memory (0: all, fetches not modeled)")
    p.add_argument("--uploads", action="store_true",
                   help="adapters arrive by upload through random replicas during the run")
    p.add_argument("--upload-window", type=float, default=0.3,
                   help="with --uploads: the fraction of the run the uploads spread over")
    p.add_argument("--forward-ms", type=float, default=FORWARD_MS)
    p.add_argument("--service-ms", type=float, default=SERVICE_MS)
    p.add_argument("--seeds", type=int, default=3, help="runs averaged per policy")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    results = {}
    for policy in ("round-robin", "affinity"):
        runs = [simulate(policy, args, seed) for seed in range(args.seeds)]
        results[policy] = {k: statistics.fmean(r[k] for r in runs) for k in runs[0]}
        logger.info("%s: %s", policy, results[policy])
    rr, af = results["round-robin"], results["affinity"]
    command = "python benchmarks/bench_affinity.py " + " ".join(argv or sys.argv[1:])
    print(f"`{command.strip()}`\n")
    uploads = (f"uploaded through random replicas over the first {args.upload_window:.0%} of "
               "the run, " if args.uploads else "")
    host = (f"{args.host_slots} host-memory adapters per replica, store fetch "
            f"{args.fetch_ms:g} ms, " if args.host_slots else "")
    print(f"3 replicas x {args.slots} slots, {args.adapters} adapters ({uploads}zipf "
          f"s={args.zipf}), {args.requests} requests at {args.rate:g} req/s (Poisson, "
          f"round-robin arrival), max_num_seqs {args.max_num_seqs}; assumed: resident TTFT "
          f"{args.resident_ms:g} ms, {host}device load {args.load_ms:g} ms, forward hop "
          f"{args.forward_ms:g} ms, decode {args.service_ms:g} ms per request; mean of "
          f"{args.seeds} seeds.\n")
    print("| routing | loads / 1000 req | store fetches / 1000 req | forwarded | mean TTFT | "
          "p50 TTFT | p99 TTFT |")
    print("|---|---|---|---|---|---|---|")
    for policy, r in results.items():
        print(f"| {policy} | {r['loads_per_1000']:.0f} | {r['fetches_per_1000']:.0f} | "
              f"{r['forwarded_pct']:.0f}% | {r['ttft_mean_ms']:.0f} ms | "
              f"{r['ttft_p50_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms |")
    ratio = rr["loads_per_1000"] / max(af["loads_per_1000"], 1e-9)
    floor = 1000.0 * placement_floor(args)
    print(f"\naffinity: {ratio:.1f}x fewer adapter loads than round-robin. Floor: "
          f"{floor:.0f} loads / 1000 req, the requests for adapters outside the "
          f"{3 * args.slots} most popular (the best static placement of independent requests "
          f"still loads those), so at best "
          f"{rr['loads_per_1000'] / max(floor, 1e-9):.1f}x fewer than round-robin here.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
