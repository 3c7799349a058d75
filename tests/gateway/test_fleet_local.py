"""A fleet without a shared object store (gateway/residency/fetch.py, gateway/fleet/router.py):
two replicas on one redis-server. A path every replica can read is served everywhere (its
bytes checked against the catalog's sha256); an upload stays on the replica that took it, the
catalog says so, and requests for it elsewhere are forwarded there (never to a replica that
does not hold it); when that replica is gone, a 503 names the adapter and why, never a 404.
The tests share one fleet; each adds the adapters it needs, so any passes alone and in any order.
"""

from __future__ import annotations

import shutil

import pytest
from fleet_harness import Fleet, running_fleet, served_by

pytestmark = pytest.mark.slow  # replica processes

RIDS = ("r1", "r2")
HELD, READABLE = "held-by-one", "read-by-all"  # `held_by_r1`'s: an upload, a shared path


@pytest.fixture(scope="module")
def module_fleet(model_dir, tmp_path_factory):
    with running_fleet(tmp_path_factory.mktemp("fleet-local"), model_dir, *RIDS) as fleet:
        yield fleet


@pytest.fixture
def fleet(module_fleet) -> Fleet:
    """The module's fleet, with a replica an earlier test killed started again."""
    module_fleet.revive(*RIDS)
    return module_fleet


@pytest.fixture
def held_by_r1(fleet, adapter_dirs) -> None:
    """HELD uploaded through r1 (its bytes there only) and READABLE registered from a path
    both replicas read, unless they are; both listed by r2."""
    fleet.ensure_adapter("r1", HELD, adapter_dirs["lora-3"])
    fleet.ensure_adapter("r1", READABLE, adapter_dirs["lora-4"], register=True)


def test_start_up_warns_that_uploads_stay_replica_local(fleet):
    assert "uploads and paths other replicas cannot read stay" in fleet.log("r1")


def test_a_path_every_replica_reads_is_served_everywhere(fleet, adapter_dirs):
    assert fleet.register("r1", "lora-5", adapter_dirs["lora-5"]).status_code == 201
    fleet.wait_for("r2 to list lora-5", lambda: "lora-5" in fleet.models("r2"), timeout=3)
    assert fleet.admin("r2")["lora-5"]["object_key"] == ""
    assert fleet.text("r2", "lora-5", marker="test") == fleet.text("r1", "lora-5",
                                                                   marker="test")


def test_an_upload_is_forwarded_to_the_replica_that_holds_it(fleet, adapter_dirs):
    assert fleet.upload("r1", "lora-6", adapter_dirs["lora-6"]).status_code == 201
    fleet.wait_for("r2 to list lora-6", lambda: "lora-6" in fleet.models("r2"), timeout=3)
    info = fleet.admin("r2")["lora-6"]
    assert info["holder"] == "r1" and info["residency"] == "remote"
    local = fleet.text("r1", "lora-6", marker="test")
    response = fleet.complete("r2", "lora-6")
    assert served_by(response) == "r1"
    assert response.json()["choices"][0]["text"] == local
    # a path only r1 could read (gone now): r1 holds its copy, r2 forwards to it
    folder = shutil.copytree(adapter_dirs["lora-7"], fleet.workdir / "lora-7-only-r1")
    assert fleet.register("r1", "lora-7", str(folder)).status_code == 201
    shutil.rmtree(folder)
    fleet.wait_for("r2 to list lora-7", lambda: "lora-7" in fleet.models("r2"), timeout=3)
    assert served_by(fleet.complete("r2", "lora-7")) == "r1"


@pytest.mark.usefixtures("held_by_r1")
def test_with_its_holder_gone_an_upload_is_a_503_naming_it(fleet):
    fleet.kill("r1")  # `fleet` starts it again for the next test
    response = fleet.complete("r2", HELD)
    assert response.status_code == 503, response.text
    message = response.json()["error"]["message"]
    assert HELD in message and "r1" in message and "adapter-store-url" in message
    assert fleet.text("r2", READABLE)  # r2 keeps serving what it can
