"""A fleet for real (gateway/fleet/router.py, gateway/residency/): adapter-affinity routing, and
a catalog every replica serves from one shared S3 store.

Unit tests for `score` and `choose`, then three `python -P -m loragw.gateway.server` replicas on one
redis-server and one S3 server (moto), started with no --adapter flags: every adapter arrives
through the admin API of one replica, as in production, and every replica serves it: uploads and
registrations, routing, a replace and a delete, a replica killed and restarted with an empty
disk, Redis restarted empty. The tests share one fleet, each asking for the state it needs
through a fixture that makes what is missing (`uploaded`, `registered`, `placed`), so any of them
passes alone and in any order.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from fleet_harness import Fleet, load_fixture_module, running_fleet, served_by
from random_adapters import write_random_adapter

from loragw.adapters.registry import ReplicaState
from loragw.gateway.fleet.router import (
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

pytestmark = pytest.mark.slow  # replica processes on one redis-server

s3_fixture = load_fixture_module("s3_server")
TTL_S = 6.0  # the registry's default residency expiry
RIDS = ("r1", "r2", "r3")
A, B = "lora-0", "lora-1"  # uploaded through r1 and r2 (`uploaded`), warmed there (`placed`)
BY_PATH = "lora-5"  # registered from a path every replica reads (`registered`)


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


# ---- three replicas, one Redis, one S3 store ------------------------------------------------
@pytest.fixture(scope="module")
def s3():
    return s3_fixture.shared_server()


@pytest.fixture(scope="module")
def module_fleet(model_dir, s3, tmp_path_factory):
    bucket = s3.create_bucket()
    with running_fleet(tmp_path_factory.mktemp("fleet"), model_dir, *RIDS, s3=s3,
                       store_url=f"s3://{bucket}/adapters",
                       extra=("--s3-allow", f"{bucket}/open/*")) as fleet:
        fleet.bucket = bucket
        yield fleet


@pytest.fixture
def fleet(module_fleet) -> Fleet:
    """The module's fleet, with a replica or Redis an earlier test left down brought back."""
    module_fleet.revive(*RIDS)
    return module_fleet


@pytest.fixture
def uploaded(fleet, adapter_dirs) -> None:
    """A uploaded through r1 and B through r2 (whichever is missing), listed everywhere."""
    fleet.ensure_adapter("r1", A, adapter_dirs[A])
    fleet.ensure_adapter("r2", B, adapter_dirs[B])


@pytest.fixture
def registered(fleet, adapter_dirs) -> None:
    """BY_PATH registered from its folder through r1 (unless it is), listed everywhere."""
    fleet.ensure_adapter("r1", BY_PATH, adapter_dirs[BY_PATH], register=True)


@pytest.fixture
def placed(fleet, uploaded) -> None:
    """A resident on r1 only and B on r2 only: each warmed there, evicted from the others."""
    for rid, adapter in (("r1", A), ("r2", B)):
        assert served_by(fleet.complete(rid, adapter, marker="warmup")) == rid
    for rid, adapter in (("r2", A), ("r3", A), ("r1", B), ("r3", B)):
        fleet.http.post(fleet.urls[rid] + f"/admin/adapters/{adapter}/evict")
    fleet.wait_for("A resident on r1 only and B on r2 only", lambda: (
        resident_on(fleet, A), resident_on(fleet, B)) == ({"r1"}, {"r2"}))


def resident_on(fleet: Fleet, adapter: str) -> set[str]:
    return {rid for rid, s in fleet.states().items() if rid in RIDS and adapter in s.resident}


def objects(fleet: Fleet) -> set[str]:
    listed = fleet.s3.client().list_objects_v2(Bucket=fleet.bucket, Prefix="adapters/")
    return {o["Key"] for o in listed.get("Contents", [])}


def test_an_upload_through_one_replica_is_served_by_every_replica(fleet, hf_config, tmp_path):
    new, other = "new-0", "new-1"  # ids and bytes no other test uploads
    folders = {name: write_random_adapter(str(tmp_path / name), hf_config, seed=seed)
               for seed, name in enumerate((new, other), start=300)}
    before = objects(fleet)
    assert fleet.upload("r1", new, folders[new]).status_code == 201
    assert fleet.upload("r2", other, folders[other]).status_code == 201
    for rid in RIDS:  # within one heartbeat, every replica lists both
        fleet.wait_for(f"{rid} to list {new} and {other}",
                       lambda rid=rid: {new, other} <= set(fleet.models(rid)), timeout=3)
    cards = [fleet.models(rid)[new] for rid in RIDS]
    assert len({(c["version"], c["sha256"]) for c in cards}) == 1
    assert fleet.models("r3")[new]["residency"] == "remote"  # not fetched there yet
    info = fleet.admin("r3")[new]
    assert info["object_key"].startswith("adapters/") and info["holder"] == ""
    added = objects(fleet) - before
    assert len(added) == 4 and before <= objects(fleet)  # two files per adapter, by content
    # every replica serves it itself (the marker), from the store, token for token alike
    texts = {rid: fleet.text(rid, new, marker="test") for rid in RIDS}
    assert len(set(texts.values())) == 1, texts
    assert texts["r1"] != fleet.text("r1", "demo-base", marker="test")
    assert fleet.models("r3")[new]["residency"] != "remote"


def test_a_path_registered_on_one_replica_is_served_by_every_replica(fleet, adapter_dirs):
    path = adapter_dirs["lora-2"]  # registered by this test only
    assert fleet.register("r1", "lora-2", path).status_code == 201
    fleet.wait_for("r3 to list lora-2", lambda: "lora-2" in fleet.models("r3"), timeout=3)
    texts = {rid: fleet.text(rid, "lora-2", marker="test") for rid in RIDS}
    assert len(set(texts.values())) == 1, texts


@pytest.mark.usefixtures("placed")
def test_requests_land_on_the_replica_holding_the_adapter(fleet):
    assert served_by(fleet.complete("r3", A)) == "r1"
    assert served_by(fleet.complete("r3", B)) == "r2"
    assert served_by(fleet.complete("r1", B)) == "r2"
    # base model: resident everywhere, so it stays where it lands
    for rid in RIDS:
        assert served_by(fleet.complete(rid, "demo-base")) == rid
    info = fleet.admin("r3")[A]
    assert "r1" in info["resident_on"] and "r3" not in info["resident_on"]


@pytest.mark.usefixtures("uploaded")
def test_auth_is_passed_on_and_checked(fleet):
    response = fleet.http.post(fleet.urls["r3"] + "/v1/completions",
                               json={"model": A, "prompt": "x", "max_tokens": 1},
                               headers={"Authorization": ""})
    assert response.status_code == 401  # refused before any routing


@pytest.mark.usefixtures("placed")
def test_streaming_through_a_forward(fleet):
    def stream(rid: str, marker: str | None):
        headers = {FORWARDED_HEADER: marker} if marker else {}
        body = {"model": A, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
                "stream": True}
        events = []
        with fleet.http.stream("POST", fleet.urls[rid] + "/v1/completions", json=body,
                               headers=headers) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            by = response.headers["x-served-by"]
            events = [line.removeprefix("data: ") for line in response.iter_lines()
                      if line.startswith("data: ")]
        return by, "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]), events

    by, text, events = stream("r3", None)
    assert by == "r1" and events[-1] == "[DONE]" and len(events) > 3
    local_by, local_text, _ = stream("r1", "test")
    assert local_by == "r1" and text == local_text and text


@pytest.mark.usefixtures("placed")
def test_a_forwarded_request_is_never_forwarded_again(fleet):
    """B is resident on r2; with the marker set, r1 serves B itself instead of a second hop."""
    assert served_by(fleet.complete("r1", B, marker="r3")) == "r1"


@pytest.mark.usefixtures("uploaded")
def test_a_replace_is_served_everywhere_once_it_returns(fleet, hf_config, tmp_path):
    """No replica serves the old weights after the replace returns, even for a prompt whose
    KV blocks the prefix cache holds from the old weights."""
    long_prompt = "In a land far away, beyond the seven mountains and the seven seas, " * 3
    before = {rid: fleet.text(rid, A, marker="test", prompt=long_prompt)
              for rid in RIDS}  # now cached everywhere
    old_objects = objects(fleet)
    version = fleet.models("r3")[A]["version"]
    new = write_random_adapter(str(tmp_path / "new"), hf_config, seed=999)
    response = fleet.upload("r3", A, new, replace=True)
    assert response.status_code == 201 and response.json()["version"] == version + 1
    after = {rid: fleet.text(rid, A, marker="test", prompt=long_prompt) for rid in RIDS}
    assert len(set(after.values())) == 1 and after["r1"] != before["r1"], (before, after)
    assert {fleet.models(rid)[A]["version"] for rid in RIDS} == {version + 1}
    fresh = objects(fleet) - old_objects
    # the old pair stays while the old version is kept (--adapter-versions-kept, default 3)
    assert len(fresh) == 2 and objects(fleet) == old_objects | fresh


@pytest.mark.usefixtures("uploaded")
def test_a_delete_is_404_everywhere_and_its_objects_leave_the_bucket(fleet):
    key = fleet.admin("r1")[B]["object_key"]
    assert fleet.delete("r2", B).status_code == 200
    for rid in RIDS:
        response = fleet.complete(rid, B)
        assert response.status_code == 404, (rid, response.text)
        assert B not in fleet.models(rid)
    assert not any(k.startswith(key) for k in objects(fleet))
    assert B not in fleet.catalog()


@pytest.mark.usefixtures("uploaded")
def test_bad_sources_are_clear_errors_and_change_nothing(fleet, adapter_dirs, hf_config,
                                                         tmp_path):
    s3 = fleet.s3.client()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        with open(f"{adapter_dirs['lora-3']}/{name}", "rb") as f:
            s3.put_object(Bucket=fleet.bucket, Key=f"open/lora-3/{name}", Body=f.read())
            s3.put_object(Bucket=fleet.bucket, Key=f"closed/lora-3/{name}", Body=b"x")
    # an s3:// folder registered on one replica is served by every replica
    source = f"s3://{fleet.bucket}/open/lora-3/"
    assert fleet.register("r1", "from-s3", source).status_code == 201
    fleet.wait_for("r3 to list from-s3", lambda: "from-s3" in fleet.models("r3"), timeout=3)
    assert fleet.text("r3", "from-s3", marker="test") == fleet.text("r1", "from-s3",
                                                                     marker="test")
    # an s3:// model name inside --s3-allow is fetched on first use; outside it is unknown
    assert fleet.complete("r2", f"s3://{fleet.bucket}/open/lora-3").status_code == 200
    refused = fleet.complete("r2", f"s3://{fleet.bucket}/closed/lora-3")
    assert refused.status_code == 404 and "closed/lora-3" in refused.json()["error"]["message"]
    before = set(fleet.admin("r2"))
    for source, status, named in (("s3://no-such-bucket/x/", 404, "no-such-bucket"),
                                  (f"s3://{fleet.bucket}/missing/", 404, "missing")):
        response = fleet.register("r2", "bad", source)
        assert response.status_code == status, response.text
        assert named in response.json()["error"]["message"]
    assert set(fleet.admin("r2")) == before and "bad" not in fleet.catalog()
    # tampered bytes in the store: a replica that must fetch them refuses, naming sha256 (an
    # adapter of this test's own, bytes and all: no other test is served the tampered pair)
    folder = write_random_adapter(str(tmp_path / "tampered"), hf_config, seed=400)
    assert fleet.upload("r1", "tampered", folder).status_code == 201
    key = fleet.admin("r1")["tampered"]["object_key"]
    s3.put_object(Bucket=fleet.bucket, Key=f"{key}/adapter_model.safetensors", Body=b"evil")
    try:
        fleet.start("r4", empty_disk=True)
        tampered = fleet.complete("r4", "tampered", marker="test")
        assert tampered.status_code == 502 and "sha256" in tampered.json()["error"]["message"]
        assert fleet.text("r4", A, marker="test")  # r4 keeps serving everything else
    finally:
        fleet.kill("r4")


def test_a_replica_the_store_refuses_exits_at_start_up_naming_credentials(fleet):
    fleet.start("r5", env_changes={"AWS_SECRET_ACCESS_KEY": "wrong"}, wait=False)
    assert fleet.procs["r5"].wait(timeout=60) != 0
    assert "credentials" in fleet.log("r5")


@pytest.mark.usefixtures("uploaded", "registered")
def test_a_killed_replica_leaves_its_uploads_served_and_comes_back_empty(fleet, adapter_dirs):
    assert fleet.upload("r1", "lora-4", adapter_dirs["lora-4"]).status_code == 201
    fleet.kill("r1")  # SIGKILL right after the upload (`fleet` restarts r1 if this fails)
    expected = fleet.text("r2", "lora-4", marker="test")
    assert fleet.text("r3", "lora-4", marker="test") == expected
    assert served_by(fleet.complete("r3", A)) in ("r2", "r3")  # r1 is gone: never a 5xx
    waited = fleet.wait_for("r1's residency to expire", lambda: "r1" not in fleet.states(),
                            timeout=TTL_S + 5)
    assert waited <= TTL_S + 1
    fleet.start("r1", empty_disk=True)
    assert {A, BY_PATH, "lora-4"} <= set(fleet.models("r1"))
    assert fleet.text("r1", "lora-4", marker="test") == expected


@pytest.mark.usefixtures("uploaded")
def test_redis_restarted_empty_is_refilled_and_nobody_fails(fleet):
    ids = fleet.catalog()
    assert {A, B} <= ids
    failures, stop = [], threading.Event()

    def traffic():
        while not stop.is_set():
            for rid in ("r2", "r3"):
                response = fleet.complete(rid, A, marker="test")
                if response.status_code != 200:
                    failures.append((rid, response.status_code, response.text))
            time.sleep(0.05)

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        time.sleep(0.5)
        fleet.redis_server.restart()  # back on the same port, empty
        assert fleet.catalog() == set() or fleet.catalog() <= ids
        fleet.wait_for("the catalog refilled", lambda: fleet.catalog() == ids, timeout=4)
        time.sleep(1.0)
    finally:
        stop.set()
        thread.join()
    assert not failures, failures[:3]
    for rid in RIDS:
        assert set(ids) <= set(fleet.models(rid))
