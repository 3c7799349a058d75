"""Versions you can pin, on a fleet as production runs one (gateway/residency/versions.py):
two replicas, one redis-server, one S3 store, --adapter-versions-kept 2, every version of `bot`
uploaded through the admin API of one replica or the other.

In order on one fleet: v1 uploaded and served; a stream on v1 across the upload of v2 ends with
v1's tokens (the offline engine's); `bot@1` stays servable on both replicas after the replace,
`bot` is v2, `bot@sha256:PREFIX` pins by content, and each response names its version in
X-Adapter-Version; v3 pushes v1 out of the store (disk, catalog and S3), and `bot@1` then
answers 404 naming the kept versions.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import pytest
from fleet_harness import load_fixture_module, running_fleet
from prometheus_client.parser import text_string_to_metric_families
from random_adapters import write_random_adapter

from loragw.adapters.registry import CatalogEntry
from loragw.engine import LLM, SamplingParams
from loragw.gateway.common.errors import APIError
from loragw.gateway.residency.versions import (
    Pin,
    object_keys,
    parse_pin,
    resolve,
    versions_of,
    with_history,
)

s3_fixture = load_fixture_module("s3_server")
PROMPT = "Once upon a time"
LONG = 200  # tokens of the stream that spans a replace
VERSION = "x-adapter-version"


@pytest.fixture(scope="module")
def versions(hf_config, tmp_path_factory) -> dict[int, str]:
    root = tmp_path_factory.mktemp("bot-versions")
    return {v: write_random_adapter(str(root / f"v{v}"), hf_config, seed=700 + v)
            for v in (1, 2, 3)}


@pytest.fixture(scope="module")
def expected(model_dir, versions) -> dict[int, dict[int, str]]:
    """The offline engine's greedy text of each version, for 8 and LONG tokens."""
    llm = LLM(model_dir, device="cpu", max_model_len=256, max_loras=3)
    out: dict[int, dict[int, str]] = {}
    for v, path in versions.items():
        llm.add_adapter(f"v{v}", path)
        out[v] = {n: llm.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0.0,
                                                           ignore_eos=True),
                                  adapters=[f"v{v}"])[0].text for n in (8, LONG)}
    return out


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):
    s3 = s3_fixture.shared_server()
    bucket = s3.create_bucket()
    with running_fleet(tmp_path_factory.mktemp("rollouts"), model_dir, "r1", "r2", s3=s3,
                       store_url=f"s3://{bucket}/adapters",
                       extra=("--adapter-versions-kept", "2")) as fleet:
        fleet.bucket = bucket
        yield fleet


def complete(fleet, rid: str, model: str, marker: str | None = "test", max_tokens: int = 8):
    """One greedy completion served by `rid` itself (the marker keeps it from forwarding)."""
    return fleet.complete(rid, model, marker, prompt=PROMPT, max_tokens=max_tokens,
                          ignore_eos=True)


def served(fleet, rid: str, model: str) -> tuple[str, str]:
    response = complete(fleet, rid, model)
    assert response.status_code == 200, (rid, model, response.text)
    return response.json()["choices"][0]["text"], response.headers[VERSION]


def objects(fleet) -> set[str]:
    listed = fleet.s3.client().list_objects_v2(Bucket=fleet.bucket, Prefix="adapters/")
    return {o["Key"] for o in listed.get("Contents", [])}


def held(fleet, rid: str) -> set[str]:
    """The adapters and earlier versions `rid` reports in loragw_adapter_residency."""
    text = fleet.http.get(fleet.urls[rid] + "/metrics").text
    return {s.labels["adapter"] for family in text_string_to_metric_families(text)
            if family.name == "loragw_adapter_residency" for s in family.samples}


def sha256(folder: str) -> str:
    with open(os.path.join(folder, "adapter_model.safetensors"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# ---- the pin grammar and the history a catalog entry carries ---------------------------------
def entry(version: int, sha: str, kept=()) -> CatalogEntry:
    return CatalogEntry("bot", "upload", None, sha * 64, 8, ("q_proj",), 10, version,
                        object_key=f"k{version}", kept=tuple(kept))


def test_pins_parse_and_resolve():
    assert parse_pin("bot@3") == ("bot", Pin(3))
    assert parse_pin("org/bot@sha256:ab12") == ("org/bot", Pin(sha256_prefix="ab12"))
    for model in ("bot", "bot@", "bot@0", "bot@x", "bot@sha256:ab1", "bot@sha256:XYZW"):
        assert parse_pin(model)[1] is None, model
    history = None
    for version, sha in ((1, "a"), (2, "b"), (3, "c"), (4, "d")):
        history = with_history(entry(version, sha), history, versions_kept=3)
    assert [e.version for e in versions_of(history)] == [4, 3, 2]
    assert all(e.kept == () for e in history.kept) and object_keys(history) == {"k4", "k3", "k2"}
    assert resolve(history, Pin(2), "bot@2").version == 2
    assert resolve(history, Pin(sha256_prefix="cccc"), "x").version == 3
    with pytest.raises(APIError) as gone:
        resolve(history, Pin(1), "bot@1")
    assert gone.value.status == 404 and "bot@4, bot@3, bot@2" in str(gone.value)
    assert with_history(entry(5, "e"), history, versions_kept=1).kept == ()


def test_v1_is_served_and_named(fleet, versions, expected):
    assert fleet.upload("r1", "bot", versions[1]).status_code == 201
    fleet.wait_for("r2 to list bot", lambda: "bot" in fleet.models("r2"), timeout=3)
    for rid in ("r1", "r2"):
        assert served(fleet, rid, "bot") == (expected[1][8], "bot@1")
        assert served(fleet, rid, "bot@1") == (expected[1][8], "bot@1")


def test_a_stream_on_v1_ends_on_v1_across_the_replace(fleet, versions, expected):
    body = {"model": "bot@1", "prompt": PROMPT, "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with fleet.http.stream("POST", fleet.urls["r1"] + "/v1/completions", json=body,
                           headers={"X-LoRAGW-Forwarded": "test"}) as response:
        assert response.status_code == 200 and response.headers[VERSION] == "bot@1"
        lines = response.iter_lines()
        events = [next(line for line in lines if line.startswith("data: "))]
        # v2 arrives through the other replica while the stream runs; r1 follows the catalog
        # and loads v2 for a new request, with the stream still on v1's slot
        assert fleet.upload("r2", "bot", versions[2], replace=True).status_code == 201
        fleet.wait_for("r1 to see v2", lambda: fleet.models("r1")["bot"]["version"] == 2,
                       timeout=3)
        assert served(fleet, "r1", "bot") == (expected[2][8], "bot@2")
        running = fleet.http.get(fleet.urls["r1"] + "/metrics").text
        assert "loragw_num_requests_running 1.0" in running, "the stream ended before the replace"
        events += [line for line in lines if line.startswith("data: ")]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected[1][LONG]


def test_an_earlier_version_stays_servable_everywhere(fleet, versions, expected):
    fleet.wait_for("r2 to see v2", lambda: fleet.models("r2")["bot"]["version"] == 2, timeout=3)
    for rid in ("r1", "r2"):
        assert served(fleet, rid, "bot") == (expected[2][8], "bot@2")
        assert served(fleet, rid, "bot@1") == (expected[1][8], "bot@1")
        assert served(fleet, rid, "bot@2") == (expected[2][8], "bot@2")
        assert served(fleet, rid, f"bot@sha256:{sha256(versions[1])[:12]}") == (expected[1][8],
                                                                                "bot@1")
    # without the marker the router may forward: the version still travels with the answer
    response = complete(fleet, "r2", "bot@1", marker=None)
    assert response.status_code == 200 and response.headers[VERSION] == "bot@1"
    assert response.json()["model"] == "bot@1"  # what the client sent
    # the logs number versions as the catalog does, however often a replica loaded them
    for rid in ("r1", "r2"):
        log = (fleet.workdir / f"{rid}.log").read_text(errors="replace")
        loads = re.findall(r"adapter bot(?:@\d)? ?(\(v\d+\))? loaded into slot", log)
        assert loads and set(loads) <= {"(v1)", "(v2)"}, (rid, loads)


def test_versions_beyond_the_limit_leave_the_store(fleet, versions, expected):
    before = objects(fleet)
    assert all("bot@1" in held(fleet, rid) for rid in ("r1", "r2"))  # served for pins above
    assert fleet.upload("r1", "bot", versions[3], replace=True).status_code == 201
    for rid in ("r1", "r2"):
        fleet.wait_for(f"{rid} to see v3", lambda rid=rid: fleet.models(rid)["bot"]["version"]
                       == 3, timeout=3)
        assert served(fleet, rid, "bot") == (expected[3][8], "bot@3")
        assert served(fleet, rid, "bot@2") == (expected[2][8], "bot@2")
        gone = complete(fleet, rid, "bot@1")
        assert gone.status_code == 404, gone.text
        message = gone.json()["error"]["message"]
        assert "bot@3, bot@2" in message and "--adapter-versions-kept" in message
        # the engine copy of v1 is gone, on the replica that replaced as on the one that followed
        assert "bot@1" not in held(fleet, rid), rid
    info = fleet.http.get(fleet.urls["r2"] + "/admin/adapters/bot").json()
    assert (info["version"], info["versions"]) == (3, [3, 2])
    # v1's pair left the S3 store (content-addressed: v2's and v3's stay)
    after = objects(fleet)
    assert len(after) == len(before) and after != before
    for rid in ("r1", "r2"):
        kept = fleet.workdir / f"{rid}-store" / "bases"
        names = {p.name for p in kept.glob("*/.kept/bot/*")}
        assert "1" not in names, (rid, names)


def test_a_pin_a_key_may_not_use_or_that_never_was(fleet):
    for model in ("bot@9", "bot@sha256:0000ffff", "nobot@1"):
        response = complete(fleet, "r1", model)
        assert response.status_code == 404, (model, response.text)
