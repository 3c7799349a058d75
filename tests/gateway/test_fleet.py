"""Adapter-affinity routing across replicas (gateway/fleet/router.py).

Unit tests for `score` and `choose`, then a real fleet on loopback: one redis-server and three
`python -m gateway.server` processes (--redis-url, --replica-id, --advertise-url, 3 slots each)
serving the demo model and the directory's random adapters. Every response names the replica
that generated it in `X-Served-By`.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from adapters.registry import ReplicaState, decode_state
from gateway.fleet.router import (
    FORWARD_MARGIN,
    FORWARDED_HEADER,
    QUEUE_PENALTY,
    SCORE_FREE_SLOT,
    SCORE_LOADING,
    SCORE_NONE,
    SCORE_RESIDENT,
    choose,
    score,
)

# tests/adapters is not a package (and `adapters` is the project's): load the fixture module
# by path rather than copying it.
_spec = importlib.util.spec_from_file_location(
    "redis_server_fixture", Path(__file__).parent.parent / "adapters" / "redis_server.py")
redis_fixture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(redis_fixture)

REPO = Path(__file__).resolve().parents[2]
REPLICAS = ("r1", "r2", "r3")
SLOTS = 3
TTL_S = 6.0  # the registry's default residency expiry (no flag sets it yet)
START_TIMEOUT_S = 150.0
A, B = "lora-0", "lora-1"  # warmed on r1 and r2


# ---- score and choose ---------------------------------------------------------------------
def state(rid: str, resident=(), loading=(), free_slots=0, queue_depth=0) -> ReplicaState:
    return ReplicaState(rid, f"http://{rid}", tuple(resident), tuple(loading), free_slots,
                        queue_depth, 0.0)


def test_score_follows_affinity_order():
    assert score(state("x", resident=["a"]), "a") == SCORE_RESIDENT
    assert score(state("x", loading=["a"], free_slots=1), "a") == SCORE_LOADING
    assert score(state("x", free_slots=1), "a") == SCORE_FREE_SLOT
    assert score(state("x", resident=["b"]), "a") == SCORE_NONE
    assert SCORE_RESIDENT > SCORE_FREE_SLOT > SCORE_LOADING > SCORE_NONE


def test_base_model_counts_as_resident_everywhere():
    assert score(state("x", resident=["b"]), None) == SCORE_RESIDENT
    # equal load: stay local; a deep local queue: spread
    assert choose([state("x"), state("y")], "x", None) is None
    deep = round(FORWARD_MARGIN / QUEUE_PENALTY) + 1
    assert choose([state("x", queue_depth=deep), state("y")], "x", None).replica_id == "y"


def test_queue_depth_lowers_the_score():
    assert score(state("x", resident=["a"], queue_depth=4), "a") == pytest.approx(
        SCORE_RESIDENT - 4 * QUEUE_PENALTY)


def test_choose_forwards_to_the_resident_replica():
    states = [state("x", free_slots=3), state("y", resident=["a"], free_slots=2),
              state("z", free_slots=3)]
    assert choose(states, "x", "a").replica_id == "y"
    assert choose(states, "y", "a") is None  # already here


def test_ties_and_small_leads_stay_local():
    assert choose([state("x", free_slots=1), state("y", free_slots=3)], "x", "a") is None
    both = [state("x", resident=["a"]), state("y", resident=["a"])]
    assert choose(both, "x", "a") is None
    # a lead of at most FORWARD_MARGIN is not worth a hop
    small = [state("x", resident=["a"], queue_depth=1), state("y", resident=["a"])]
    assert SCORE_RESIDENT - score(small[0], "a") <= FORWARD_MARGIN
    assert choose(small, "x", "a") is None


def test_hot_adapter_spreads_once_its_replica_queues():
    """Resident on y only: x forwards while y is idle, loads it itself once y is busy."""
    idle = [state("x", free_slots=1), state("y", resident=["a"])]
    assert choose(idle, "x", "a").replica_id == "y"
    for depth in range(0, 20):
        busy = [state("x", free_slots=1), state("y", resident=["a"], queue_depth=depth)]
        forwards = choose(busy, "x", "a") is not None
        assert forwards == (SCORE_RESIDENT - depth * QUEUE_PENALTY
                            > SCORE_FREE_SLOT + FORWARD_MARGIN)
    assert choose([state("x", free_slots=1),
                   state("y", resident=["a"], queue_depth=2)], "x", "a") is None


def test_unknown_local_state_or_lone_replica_serves_locally():
    assert choose([state("y", resident=["a"])], "x", "a") is None  # not yet published
    assert choose([state("x")], "x", "a") is None
    assert choose([], "x", "a") is None


# ---- a fleet of three replicas --------------------------------------------------------------
class Fleet:
    def __init__(self, redis_server, procs: dict, urls: dict):
        self.redis_server, self.procs, self.urls = redis_server, procs, urls
        self.http = httpx.Client(timeout=60)
        self.redis = redis.Redis.from_url(redis_server.url)

    def states(self) -> dict[str, ReplicaState]:
        out = {}
        for rid in REPLICAS:
            raw = self.redis.get(f"loragw:replica:{rid}")
            if raw is not None:
                out[rid] = decode_state(raw)
        return out

    def wait_for(self, what: str, predicate, timeout: float = 20.0) -> float:
        started = time.monotonic()
        while not predicate():
            assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
            time.sleep(0.1)
        return time.monotonic() - started

    def complete(self, rid: str, model: str, marker: str | None = None,
                 **extra) -> httpx.Response:
        headers = {"Authorization": "Bearer fleet-key"}
        if marker:
            headers[FORWARDED_HEADER] = marker
        body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 8,
                "temperature": 0, **extra}
        return self.http.post(self.urls[rid] + "/v1/completions", json=body, headers=headers)


def _free_port() -> int:
    return redis_fixture.free_port()


@pytest.fixture(scope="module")
def fleet(model_dir, adapter_dirs, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fleet")
    redis_server = redis_fixture.RedisServer(workdir)
    redis_server.start()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs, urls, logs = {}, {}, {}
    adapters = [a for name, path in adapter_dirs.items() for a in ("--adapter", f"{name}={path}")]
    try:
        for rid in REPLICAS:
            port = _free_port()
            urls[rid] = f"http://127.0.0.1:{port}"
            logs[rid] = open(workdir / f"{rid}.log", "wb")
            procs[rid] = subprocess.Popen(
                [sys.executable, "-m", "gateway.server", "--model", model_dir,
                 "--served-model-name", "demo-base", "--device", "cpu",
                 "--max-model-len", "256", "--max-num-seqs", "4", "--max-loras", str(SLOTS),
                 "--port", str(port), "--redis-url", redis_server.url, "--replica-id", rid,
                 "--advertise-url", urls[rid], "--api-key", "fleet-key",
                 "--adapter-dir", str(workdir / f"{rid}-store"), *adapters],
                cwd=REPO, env=env, stdout=logs[rid], stderr=subprocess.STDOUT)
        fleet = Fleet(redis_server, procs, urls)
        deadline = time.monotonic() + START_TIMEOUT_S
        for rid in REPLICAS:
            while True:
                assert procs[rid].poll() is None, (
                    f"replica {rid} exited:\n{(workdir / f'{rid}.log').read_text()[-3000:]}")
                assert time.monotonic() < deadline, f"replica {rid} never became ready"
                try:
                    if fleet.http.get(urls[rid] + "/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        fleet.wait_for("all replicas in the registry", lambda: len(fleet.states()) == 3)
        yield fleet
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in logs.values():
            log.close()
        redis_server.kill()


def _served_by(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.headers["x-served-by"]


def test_requests_land_on_the_replica_holding_the_adapter(fleet):
    # warm-up: the marker makes each replica serve these itself
    assert _served_by(fleet.complete("r1", A, marker="warmup")) == "r1"
    assert _served_by(fleet.complete("r2", B, marker="warmup")) == "r2"
    fleet.wait_for("A resident on r1 and B on r2 in the registry", lambda: (
        A in fleet.states()["r1"].resident and B in fleet.states()["r2"].resident))

    local = fleet.complete("r1", A, marker="test")
    forwarded = fleet.complete("r3", A)
    assert _served_by(forwarded) == "r1"
    assert forwarded.json()["choices"][0]["text"] == local.json()["choices"][0]["text"]
    assert _served_by(fleet.complete("r3", B)) == "r2"
    assert _served_by(fleet.complete("r1", B)) == "r2"
    assert _served_by(fleet.complete("r2", A)) == "r1"
    # base model: resident everywhere, so it stays where it lands
    for rid in REPLICAS:
        assert _served_by(fleet.complete(rid, "demo-base")) == rid
    assert A not in fleet.states()["r3"].resident  # r3 never loaded A


def test_auth_is_passed_on_and_checked(fleet):
    response = fleet.http.post(fleet.urls["r3"] + "/v1/completions",
                               json={"model": A, "prompt": "x", "max_tokens": 1})
    assert response.status_code == 401  # refused before any routing


def test_streaming_through_a_forward(fleet):
    def stream(rid: str, marker: str | None):
        headers = {"Authorization": "Bearer fleet-key"}
        if marker:
            headers[FORWARDED_HEADER] = marker
        body = {"model": A, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
                "stream": True}
        events = []
        with fleet.http.stream("POST", fleet.urls[rid] + "/v1/completions", json=body,
                               headers=headers) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            served_by = response.headers["x-served-by"]
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
        return served_by, events

    served_by, events = stream("r3", None)
    assert served_by == "r1"
    assert events[-1] == "[DONE]" and len(events) > 3
    text = "".join(httpx.Response(200, content=e).json()["choices"][0]["text"]
                   for e in events[:-1])
    local_by, local_events = stream("r1", "test")
    assert local_by == "r1"
    local_text = "".join(httpx.Response(200, content=e).json()["choices"][0]["text"]
                         for e in local_events[:-1])
    assert text == local_text and text


def test_a_forwarded_request_is_never_forwarded_again(fleet):
    """B is resident on r2; with the marker set, r1 serves B itself instead of a second hop."""
    assert B not in fleet.states()["r1"].resident
    assert _served_by(fleet.complete("r1", B, marker="r3")) == "r1"
    chat = fleet.http.post(fleet.urls["r3"] + "/v1/chat/completions", json={
        "model": A, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        headers={"Authorization": "Bearer fleet-key", FORWARDED_HEADER: "r2"})
    assert _served_by(chat) == "r3"


def test_a_killed_replica_expires_and_its_adapters_are_served_elsewhere(fleet):
    fleet.procs["r1"].kill()  # SIGKILL: no deregistration, only the heartbeat stops
    fleet.procs["r1"].wait(timeout=10)
    # still registered as holding A: r3 tries it, fails to connect, serves A itself
    assert "r1" in fleet.states()
    assert _served_by(fleet.complete("r3", A)) == "r3"
    waited = fleet.wait_for("r1's residency to expire", lambda: "r1" not in fleet.states(),
                            timeout=TTL_S + 5)
    assert waited <= TTL_S + 1
    fleet.wait_for("A resident on r3", lambda: A in fleet.states()["r3"].resident)
    assert _served_by(fleet.complete("r2", A)) == "r3"


def test_redis_down_every_replica_serves_locally(fleet):
    fleet.redis_server.kill()
    time.sleep(0.5)  # past the router's state cache
    for rid, model in (("r2", A), ("r3", B), ("r2", "demo-base"), ("r3", A)):
        assert _served_by(fleet.complete(rid, model)) == rid
