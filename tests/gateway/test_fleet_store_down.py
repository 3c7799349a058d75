"""A fleet whose shared S3 store goes down (gateway/residency/fetch.py StoreHealth,
gateway/residency/heartbeat.py, gateway/fleet/router.py): two replicas on one redis-server and
a moto S3 server in a process of its own, stopped the way an outage takes a store away.

An adapter another replica holds, in host memory or on disk, is still served: by that replica,
never a 503 from the one asked. With no holder left, the 503 says the store is down
(`adapter_store_unavailable`, Retry-After), not that the adapter is invalid.

A store taken down stays down (its process and buckets are gone), so the fleets come from
`fleets`: a test that needs the store up after another took it down gets a fleet of its own.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from urllib.parse import urlsplit

import pytest
from fleet_harness import KEY, Fleet, load_fixture_module, running_fleet, served_by

from loragw.adapters.registry import ReplicaState
from loragw.adapters.registry_types import encode
from loragw.adapters.store_meta import StoredAdapter
from loragw.engine.snapshot import EngineSnapshot
from loragw.gateway.common.records import AdapterRecord
from loragw.gateway.residency.heartbeat import HELD_PUBLISHED, holders, replica_state
from loragw.gateway.residency.info import catalog_entry

pytestmark = pytest.mark.slow  # replica processes, an S3 server

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
RIDS = ("a", "b")


@contextmanager
def store_fleet(workdir, model_dir: str) -> Iterator[Fleet]:
    """Replicas a and b on an S3 server in a process of its own (the tests stop it)."""
    s3 = s3_fixture.S3Server(process=True)
    s3.start()
    try:
        with running_fleet(workdir, model_dir, *RIDS, s3=s3,
                           store_url=f"s3://{s3.create_bucket()}/adapters") as fleet:
            yield fleet
    finally:
        s3.stop()


def answers(endpoint: str) -> bool:
    parts = urlsplit(endpoint)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=1):
            return True
    except OSError:
        return False


class StoreFleets:
    """The module's fleet, and a new one (the spent one stopped) whenever a test needs the
    store up after an earlier test took it down."""

    def __init__(self, start: Callable[[], AbstractContextManager[Fleet]]):
        self._start, self._stack = start, ExitStack()
        self.fleet: Fleet | None = None

    def with_store_up(self) -> Fleet:
        if self.fleet is None or not answers(self.fleet.s3.endpoint):
            self.close()
            self.fleet = self._stack.enter_context(self._start())
        self.fleet.revive(*RIDS)
        return self.fleet

    def close(self) -> None:
        self._stack.close()
        self.fleet = None


@pytest.fixture(scope="module")
def fleets(model_dir, tmp_path_factory) -> Iterator[StoreFleets]:
    fleets = StoreFleets(lambda: store_fleet(tmp_path_factory.mktemp("fleet-store-down"),
                                             model_dir))
    try:
        yield fleets
    finally:
        fleets.close()


@pytest.fixture
def fleet(fleets) -> Fleet:
    """A fleet whose store answers."""
    return fleets.with_store_up()


@pytest.fixture
def store_gone(fleets, adapter_dirs) -> Fleet:
    """A fleet whose store went down after ADAPTER was uploaded through a, and b listed it."""
    fleet = fleets.fleet
    if fleet is None or ADAPTER not in fleet.catalog():
        fleet = fleets.with_store_up()
        fleet.ensure_adapter("a", ADAPTER, adapter_dirs["lora-0"])
    fleet.revive("b")
    fleet.s3.stop()  # a no-op when it is down already
    return fleet


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


def test_with_the_store_down_and_no_holder_it_is_a_503_naming_the_store(store_gone,
                                                                        adapter_dirs):
    fleet = store_gone
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
