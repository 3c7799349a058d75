"""Fleet placement on a real fleet: three `loragw serve` replicas on one redis-server, sharing
adapter bytes through a real S3 server, the adapters uploaded through the admin API.

Each replica says it carries CAPACITY tokens/s at full load (--replica-tokens-per-s), so a copy
is planned for 70% of that, and demand is averaged over 6 s (--demand-window-s): a few client
threads make an adapter hot enough for three copies (on any machine, however loaded), and a
trickle afterwards needs one.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import pytest
from fleet_harness import load_fixture_module, running_fleet, served_by
from prometheus_client.parser import text_string_to_metric_families

from loragw.gateway.fleet.placement import DEFAULT_SETTINGS
from loragw.gateway.fleet.placing import TICK_S
from loragw.gateway.fleet.planner import LEASE_MS

s3_fixture = load_fixture_module("s3_server")
RIDS = ("r1", "r2", "r3")
HOT, COLD = "hot", "cold"
CAPACITY = 10.0
PER_COPY = CAPACITY * DEFAULT_SETTINGS.target_utilization
LONG = 1500  # tokens of a request that outlives a change of plan (--max-model-len 2048)


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):
    s3 = s3_fixture.shared_server()
    bucket = s3.create_bucket()
    with running_fleet(tmp_path_factory.mktemp("placement"), model_dir, *RIDS, s3=s3,
                       store_url=f"s3://{bucket}/adapters",
                       extra=("--replica-tokens-per-s", str(CAPACITY), "--demand-window-s", "6",
                              "--max-model-len", "2048")) as fleet:
        yield fleet


def placement(fleet, rid: str) -> dict:
    response = fleet.http.get(fleet.urls[rid] + "/admin/placement")
    assert response.status_code == 200, response.text
    return response.json()


def copies(fleet, rid: str, adapter: str) -> list[str]:
    rows = {row["adapter"]: row["replicas"] for row in placement(fleet, rid)["adapters"]}
    return rows.get(adapter, [])


def metric(fleet, rid: str, name: str, **labels) -> float | None:
    text = fleet.http.get(fleet.urls[rid] + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


class Load:
    """Client threads sending `adapter` completions to `rids` in turn until stopped."""

    def __init__(self, fleet, adapter: str, rids: tuple[str, ...], threads: int = 4):
        self.fleet, self.adapter, self.rids = fleet, adapter, rids
        self.stop, self.errors, self.sent = threading.Event(), [], 0
        self.threads = [threading.Thread(target=self._send, args=(i,), daemon=True)
                        for i in range(threads)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)
        assert not self.errors, self.errors[:3]

    def _send(self, i: int) -> None:
        with httpx.Client(timeout=60, headers=self.fleet.http.headers) as client:
            while not self.stop.is_set():
                rid = self.rids[(i + self.sent) % len(self.rids)]
                try:
                    r = client.post(self.fleet.urls[rid] + "/v1/completions", json={
                        "model": self.adapter, "prompt": "hello", "max_tokens": 16,
                        "ignore_eos": True, "temperature": 0})
                except httpx.TransportError as exc:
                    self.errors.append((rid, repr(exc)))
                    continue
                finally:
                    self.sent += 1
                if r.status_code != 200:
                    self.errors.append((rid, r.status_code, r.text[:200]))


def test_a_hot_adapter_gets_three_copies_its_traffic_spreads_and_they_go_when_it_cools(
        fleet, adapter_dirs):
    folders = list(adapter_dirs.values())
    fleet.ensure_adapter("r1", HOT, folders[0])
    fleet.ensure_adapter("r2", COLD, folders[1])
    with Load(fleet, HOT, ("r1",)):
        try:
            fleet.wait_for("three copies of the hot adapter", lambda: sorted(
                copies(fleet, "r2", HOT)) == list(RIDS), timeout=40)
        except AssertionError:
            print(placement(fleet, "r2"), fleet.states(), fleet.log("r1")[-3000:])
            raise
        # every replica holds the same plan, whoever computed it
        views = [placement(fleet, rid) for rid in RIDS]
        assert sum(v["leader"] for v in views) == 1
        assert len({v["computed_by"] for v in views}) == 1
        fleet.wait_for("the copies in memory", lambda: all(
            HOT in s.resident or HOT in s.host for s in fleet.states().values()), timeout=20)
        by = Counter(served_by(fleet.complete("r1", HOT)) for _ in range(30))
        assert set(by) == set(RIDS), by  # spread over the three copies, from one entry point
        sticky = {served_by(fleet.complete("r1", HOT, user="alice")) for _ in range(8)}
        assert len(sticky) == 1  # a user's requests stay on one copy
        assert metric(fleet, "r3", "loragw_adapter_copies", adapter=HOT) == 3
        leader = views[0]["computed_by"]
        assert metric(fleet, leader, "loragw_placement_moves_total") >= 2
        view = placement(fleet, "r1")
        hot = next(row for row in view["adapters"] if row["adapter"] == HOT)
        assert hot["tokens_per_s"] > 2 * PER_COPY  # more than two copies carry
        assert set(view["load_tokens_per_s"]) == set(RIDS)
        assert httpx.get(fleet.urls["r1"] + "/admin/placement").status_code == 401
        assert fleet.text("r3", COLD)  # a little demand beside it: one copy
        fleet.wait_for("one copy of the cold adapter",
                       lambda: len(copies(fleet, "r1", COLD)) == 1, timeout=10)
    # Cooled: a trickle needs one copy. A long request runs on each replica meanwhile (counted
    # as demand only when it ends): the copies the plan drops stay in memory while it runs,
    # and it ends whole.
    results: dict[str, tuple] = {}

    def long_request(rid: str) -> None:
        r = fleet.complete(rid, HOT, marker="test", max_tokens=LONG, ignore_eos=True)
        body = r.json()
        results[rid] = (r.status_code, body["choices"][0]["finish_reason"],
                        body["usage"]["completion_tokens"])

    runners = {rid: threading.Thread(target=long_request, args=(rid,)) for rid in RIDS}
    for t in runners.values():
        t.start()
    with Trickle(fleet, HOT):
        fleet.wait_for("one copy of the cooled adapter",
                       lambda: len(copies(fleet, "r1", HOT)) == 1, timeout=40)
        gone = [rid for rid in RIDS if rid not in copies(fleet, "r1", HOT)]
        running = [rid for rid in gone if runners[rid].is_alive()]
        assert running, "no long request outlived the plan's change: make LONG longer"
        time.sleep(3 * TICK_S)  # ticks that would have let it go
        states = fleet.states()
        for rid in running:
            if runners[rid].is_alive():
                assert HOT in states[rid].resident, f"{HOT} left {rid} under a running request"
        for t in runners.values():
            t.join(timeout=180)
        assert all(results[rid] == (200, "length", LONG) for rid in RIDS), results
        # the long requests' tokens count now (copies again), then fade: one copy, and the
        # replicas it left let it go, no request running there any more
        fleet.wait_for("one copy again", lambda: len(copies(fleet, "r1", HOT)) == 1, timeout=60)
        kept = copies(fleet, "r1", HOT)[0]
        fleet.wait_for("the dropped copies let go", lambda: all(
            HOT not in state.resident and HOT not in state.host
            for rid, state in fleet.states().items() if rid != kept), timeout=20)


class Trickle:
    """One one-token `adapter` request every 2 s (3 tokens/s, under PER_COPY), while entered."""

    def __init__(self, fleet, adapter: str):
        self.fleet, self.adapter, self.stop = fleet, adapter, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Trickle:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=60)

    def _run(self) -> None:
        while not self.stop.wait(2.0):
            self.fleet.complete("r1", self.adapter, max_tokens=1)


def test_the_plan_hands_over_when_its_planner_dies_and_a_joining_replica_gets_its_share(
        fleet, adapter_dirs):
    fleet.revive(*RIDS)
    fleet.ensure_adapter("r1", HOT, list(adapter_dirs.values())[0])
    with Load(fleet, HOT, RIDS):
        fleet.wait_for("three copies", lambda: sorted(copies(fleet, "r1", HOT)) == list(RIDS),
                       timeout=40)
    leader = placement(fleet, "r1")["computed_by"]
    others = [rid for rid in RIDS if rid != leader]
    with Load(fleet, HOT, tuple(others)):  # the dead one's clients move over
        fleet.kill(leader)
        took = fleet.wait_for("another planner", lambda: any(
            placement(fleet, rid)["leader"] for rid in others), timeout=10)
        # the lease lapses, then the next tick takes it: within one registry heartbeat
        assert took <= LEASE_MS / 1000 + 2 * TICK_S + 1.0, took
        new = next(rid for rid in others if placement(fleet, rid)["leader"])
        fleet.wait_for("a plan without the dead replica", lambda: set(
            copies(fleet, new, HOT)) == set(others), timeout=30)
        fleet.start(leader)  # joins again, on an empty plan of its own
        fleet.wait_for("the joining replica's share", lambda: leader in copies(
            fleet, new, HOT), timeout=30)
        fleet.wait_for("its copy in memory", lambda: HOT in fleet.states()[leader].resident
                       or HOT in fleet.states()[leader].host, timeout=20)
