"""A fleet whose shared S3 store goes down (gateway/residency/fetch.py StoreHealth,
gateway/residency/heartbeat.py, gateway/fleet/router.py): two replicas on one redis-server and
a moto S3 server in a process of its own, stopped the way an outage takes a store away.

An adapter another replica holds, in host memory or on disk, is still served: by that replica,
never a 503 from the one asked. With no holder left, the 503 says the store is down
(`adapter_store_unavailable`, Retry-After), not that the adapter is invalid.
"""

from __future__ import annotations

import pytest
from fleet_harness import KEY, load_fixture_module, running_fleet, served_by

from loragw.adapters.registry import ReplicaState
from loragw.adapters.registry_types import encode
from loragw.adapters.store_meta import StoredAdapter
from loragw.engine.snapshot import EngineSnapshot
from loragw.gateway.residency.heartbeat import HELD_PUBLISHED, holders, replica_state
from loragw.gateway.residency.info import catalog_entry
from loragw.gateway.residency.tiers import AdapterRecord

s3_fixture = load_fixture_module("s3_server")
ADAPTER = "held-by-a"


# ---- what a heartbeat says a replica holds -------------------------------------------------
def record(name: str, on_disk: bool = True) -> AdapterRecord:
    stored = StoredAdapter(name, 1, "0" * 64, 1, "upload", None, 8, ("q_proj",), 0.0)
    return AdapterRecord(catalog_entry(stored, holder=""), stored if on_disk else None)


def test_a_heartbeat_lists_host_copies_first_then_disk_and_stays_bounded():
    tiers = ({f"d{i}": "device" for i in range(2)} | {f"h{i}": "host" for i in range(3)}
             | {f"k{i:03}": "disk" for i in range(300)})  # 300: more than a heartbeat lists
    snap = EngineSnapshot(0, 0, 1, 1, 2, 0, 0, tiers, frozenset(), 0)
    records = {name: record(name) for name in [*tiers, "only-on-disk"]}
    records["remote"] = record("remote", on_disk=False)
    state = replica_state("r", "http://r", snap, records, loading=())
    assert state.resident == ("d0", "d1")
    assert state.held[:4] == ("h0", "h1", "h2", "k000") and len(state.held) == HELD_PUBLISHED
    assert "remote" not in state.held and not set(state.resident) & set(state.held)
    assert len(encode(state)) < 8 * HELD_PUBLISHED + 1024  # ids of 5 characters here
    small = replica_state("r", "http://r", snap, {"only-on-disk": record("only-on-disk")}, ())
    assert "only-on-disk" in small.held  # stored, never parsed since the restart


def test_holders_are_the_other_replicas_with_it_in_a_slot_host_memory_or_on_disk():
    states = [ReplicaState("me", "u", ("x",), (), 0, 0, 0.0, held=("x",)),
              ReplicaState("slot", "u", ("x",), (), 0, 0, 0.0),
              ReplicaState("disk", "u", (), (), 0, 0, 0.0, held=("x",)),
              ReplicaState("none", "u", ("y",), (), 0, 0, 0.0, held=("y",))]
    assert holders(states, "x", "me") == ("slot", "disk")


# ---- two replicas, one Redis, one S3 store that goes down ----------------------------------


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):
    s3 = s3_fixture.S3Server(process=True)  # its own process: the tests stop it
    s3.start()
    try:
        with running_fleet(tmp_path_factory.mktemp("fleet-store-down"), model_dir, "a", "b",
                           s3=s3, store_url=f"s3://{s3.create_bucket()}/adapters") as fleet:
            yield fleet
    finally:
        s3.stop()


def test_with_the_store_down_a_replica_holding_the_adapter_serves_it(fleet, adapter_dirs):
    assert fleet.upload("a", ADAPTER, adapter_dirs["lora-0"]).status_code == 201
    fleet.wait_for("b to list it", lambda: ADAPTER in fleet.models("b"), timeout=3)
    assert fleet.admin("b")[ADAPTER]["residency"] == "remote"  # b would fetch it from the store
    assert ADAPTER in fleet.states()["a"].held  # a's heartbeat: in its host memory
    fleet.s3.stop()
    # the key's scheme in any case, passed on to the replica that serves it
    body = {"model": ADAPTER, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
    response = fleet.http.post(fleet.urls["b"] + "/v1/completions", json=body,
                               headers={"Authorization": f"bearer {KEY}"})
    assert served_by(response) == "a"
    text = response.json()["choices"][0]["text"]
    # evicted to disk on a (out of its slot and host memory): still a's to serve
    assert fleet.http.post(fleet.urls["a"] + f"/admin/adapters/{ADAPTER}/evict").status_code == 200
    fleet.wait_for("a to publish it on disk", lambda: ADAPTER not in fleet.states()["a"].resident
                   and ADAPTER in fleet.states()["a"].held)
    assert fleet.admin("a")[ADAPTER]["residency"] == "disk"
    again = fleet.complete("b", ADAPTER)
    assert served_by(again) == "a" and again.json()["choices"][0]["text"] == text
    assert fleet.text("a", ADAPTER, marker="test") == text  # a's own answer
    assert fleet.text("b", "demo-base")  # b serves the base model meanwhile


def test_with_the_store_down_and_no_holder_it_is_a_503_naming_the_store(fleet, adapter_dirs):
    fleet.kill("a")
    response = fleet.complete("b", ADAPTER)
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "adapter_store_unavailable", error
    assert "object store" in error["message"] and fleet.s3.endpoint in error["message"]
    assert int(response.headers["retry-after"]) >= 1
    # an upload the store cannot take: the same code, and nothing in the catalog
    refused = fleet.upload("b", "new-one", adapter_dirs["lora-1"])
    assert refused.status_code == 503 and refused.json()["error"]["code"] == \
        "adapter_store_unavailable"
    assert "new-one" not in fleet.catalog()
