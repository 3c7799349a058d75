"""Speculative decoding as an OpenAI client sees it: `loragw serve --speculative-config` gives
the same greedy text as the offline engine without speculation, per adapter and streamed;
`"speculative": false` opts a request out; /metrics counts drafted and accepted tokens per
adapter; usage is unchanged."""

from __future__ import annotations

import argparse
import json
import re

import httpx
import openai
import pytest

from gateway.config import ServerConfig
from gateway.flags import add_options
from gateway.http.app import create_app
from gateway.server import BackgroundServer

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
    from engine import SamplingParams

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
