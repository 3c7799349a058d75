"""Speculative decoding as an OpenAI client sees it: `loragw serve --speculative-config` gives
the same greedy text as the offline engine without speculation, per adapter and streamed;
`"speculative": false` opts a request out; /metrics counts drafted and accepted tokens per
adapter; usage is unchanged; a draft LoRA registered beside its adapter (`draft_adapter`) drafts
for it, on every replica."""

from __future__ import annotations

import argparse
import json
import re

import httpx
import openai
import pytest
from fleet_harness import load_fixture_module, running_fleet

from loragw.gateway.app import create_app
from loragw.gateway.common.config import ServerConfig
from loragw.gateway.common.flags import add_options
from loragw.gateway.server import BackgroundServer

pytestmark = pytest.mark.slow  # servers with a draft model

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
PROMPT = "the red fox and the red fox and the red fox and the red"
GREEDY = dict(temperature=0.0, max_tokens=24, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def spec_server(server_config, tmp_path_factory):
    config = ServerConfig(**{**server_config.__dict__,
                             "adapter_dir": str(tmp_path_factory.mktemp("spec-store")),
                             "speculative_config": json.dumps(SPEC)})
    app = create_app(config)
    with BackgroundServer(app) as background:
        background.wait_ready()
        yield background


def test_flag_and_environment_reach_the_engine(tmp_path):
    parser = add_options(argparse.ArgumentParser(), ServerConfig, {})
    config = ServerConfig.from_args(parser.parse_args(
        ["--model", str(tmp_path), "--speculative-config", json.dumps(SPEC)]))
    assert json.loads(config.speculative_config) == SPEC
    env = {"LORAGW_SPECULATIVE_CONFIG": json.dumps(SPEC)}
    parser = add_options(argparse.ArgumentParser(), ServerConfig, env)
    assert ServerConfig.from_args(parser.parse_args(["--model", str(tmp_path)])) \
        .speculative_config == json.dumps(SPEC)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        ServerConfig(model=str(tmp_path), speculative_config='{"method": "ngram"}')


def test_outputs_equal_the_engine_without_speculation(spec_server, offline):
    from loragw.engine import SamplingParams

    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    want = offline.generate([PROMPT] * 2, SamplingParams(max_tokens=24, temperature=0.0,
                                                         ignore_eos=True), [None, "lora-1"])
    for model, reference in zip(("demo-base", "lora-1"), want, strict=True):
        out = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
        assert out.choices[0].text == reference.text
        assert out.usage.completion_tokens == 24
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt=PROMPT, stream=True, **GREEDY) if c.choices)
        assert streamed == reference.text
    opted_out = client.completions.create(
        model="lora-1", prompt=PROMPT, temperature=0.0, max_tokens=24,
        extra_body={"ignore_eos": True, "speculative": False})
    assert opted_out.choices[0].text == want[1].text

    with httpx.Client(base_url=spec_server.url, timeout=60) as http:
        text = http.get("/metrics").text
    drafted = {m[0]: float(m[1]) for m in re.findall(
        r'^loragw_spec_decode_num_draft_tokens_total\{adapter="([^"]+)"\} (\S+)$', text, re.M)}
    accepted = {m[0]: float(m[1]) for m in re.findall(
        r'^loragw_spec_decode_num_accepted_tokens_total\{adapter="([^"]+)"\} (\S+)$', text, re.M)}
    assert drafted.get("base", 0) > 0 and drafted.get("lora-1", 0) > 0, drafted
    assert set(accepted) == set(drafted)
    rate = float(re.search(r'^loragw_spec_decode_acceptance_rate\{adapter="base"\} (\S+)$', text,
                           re.M).group(1))
    assert rate == pytest.approx(accepted["base"] / drafted["base"])


# ---- per-adapter drafters through the admin API --------------------------------------------
@pytest.fixture(scope="module")
def draft_server(server_config, model_dir, tmp_path_factory):
    """Drafting with a draft model: the demo model itself, so an adapter whose draft LoRA is
    its own weights has every draft accepted, and one without drafts from the plain base."""
    spec = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3}
    config = ServerConfig(**{**server_config.__dict__, "adapter": (),
                             "adapter_dir": str(tmp_path_factory.mktemp("draft-store")),
                             "speculative_config": json.dumps(spec)})
    with BackgroundServer(create_app(config)) as background:
        background.wait_ready()
        yield background


def acceptance(text: str) -> dict[str, float]:
    return {m[0]: float(m[1]) for m in re.findall(
        r'^loragw_spec_decode_acceptance_rate\{adapter="([^"]+)"\} (\S+)$', text, re.M)}


def test_a_draft_adapter_registered_or_uploaded_drafts_for_its_adapter(draft_server, offline,
                                                                      adapter_dirs):
    from loragw.engine import SamplingParams

    lora1, lora2 = adapter_dirs["lora-1"], adapter_dirs["lora-2"]
    with httpx.Client(base_url=draft_server.url, timeout=120) as http:
        r = http.post("/admin/adapters/register", json={
            "adapter_id": "drafted", "source": lora1, "draft_adapter": lora1})
        assert r.status_code == 201 and r.json()["draft_adapter"] == lora1, r.text
        assert http.post("/admin/adapters/register", json={
            "adapter_id": "plain", "source": lora1}).status_code == 201
        with open(f"{lora2}/adapter_config.json", "rb") as c, \
                open(f"{lora2}/adapter_model.safetensors", "rb") as w:
            r = http.post("/admin/adapters", data={"adapter_id": "uploaded",
                                                   "draft_adapter": lora2},
                          files={"adapter_config": ("adapter_config.json", c.read()),
                                 "adapter_model": ("adapter_model.safetensors", w.read())})
        assert r.status_code == 201 and r.json()["draft_adapter"] == lora2, r.text
        want = offline.generate([PROMPT] * 2, SamplingParams(max_tokens=24, temperature=0.0,
                                                             ignore_eos=True),
                                ["lora-1", "lora-2"])
        for model, reference in (("drafted", want[0]), ("plain", want[0]),
                                 ("uploaded", want[1])):
            body = {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True}
            out = http.post("/v1/completions", json=body)
            assert out.json()["choices"][0]["text"] == reference.text, (model, out.text)
        rates = acceptance(http.get("/metrics").text)
    # its own weights as its drafter: every draft kept; the plain draft misses some
    assert rates["drafted"] == rates["uploaded"] == 1.0, rates
    assert rates["plain"] < 1.0, rates


def test_a_bad_draft_adapter_changes_nothing(draft_server, spec_server, adapter_dirs, tmp_path):
    lora1 = adapter_dirs["lora-1"]
    with httpx.Client(base_url=draft_server.url, timeout=60) as http:
        for draft, status in ((str(tmp_path / "missing"), 404), ("s3://", 400)):
            r = http.post("/admin/adapters/register", json={
                "adapter_id": "bad-draft", "source": lora1, "draft_adapter": draft})
            assert r.status_code == status, r.text
            assert http.get("/admin/adapters/bad-draft").status_code == 404
    with httpx.Client(base_url=spec_server.url, timeout=60) as http:  # ngram: no draft model
        r = http.post("/admin/adapters/register", json={
            "adapter_id": "no-draft-model", "source": lora1, "draft_adapter": lora1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "draft_adapter", r.text
        assert http.get("/admin/adapters/no-draft-model").status_code == 404


def test_every_replica_loads_the_drafter_with_its_adapter(model_dir, adapter_dirs,
                                                          tmp_path_factory):
    """Two replicas, one redis-server, one S3 store: an adapter registered on r1 with its
    draft LoRA is fetched by r2 on first use together with that drafter (every draft kept)."""
    s3 = load_fixture_module("s3_server").shared_server()
    spec = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3}
    lora1 = adapter_dirs["lora-1"]
    with running_fleet(tmp_path_factory.mktemp("draft-fleet"), model_dir, "r1", "r2", s3=s3,
                       store_url=f"s3://{s3.create_bucket()}/adapters",
                       extra=("--speculative-config", json.dumps(spec))) as fleet:
        r = fleet.http.post(
            fleet.urls["r1"] + "/admin/adapters/register",
            json={"adapter_id": "drafted", "source": lora1, "draft_adapter": lora1})
        assert r.status_code == 201, r.text
        fleet.wait_for("r2 to list it", lambda: "drafted" in fleet.models("r2"), timeout=3)
        assert fleet.admin("r2")["drafted"]["draft_adapter"] == lora1
        assert fleet.complete("r2", "drafted", marker="test", max_tokens=24,
                              ignore_eos=True).status_code == 200
        rates = acceptance(fleet.http.get(fleet.urls["r2"] + "/metrics").text)
    assert rates["drafted"] == 1.0, rates
