"""`loragw serve --async-scheduling` as an OpenAI client sees it: the engine (in its own
process) launches each step before reading the step before's tokens, and clients get the
synchronous offline engine's text, streamed or not, per adapter, with stop strings; a client
that leaves mid-stream aborts a request whose token is in flight and the server is idle and
serving after it. The flag is refused beside speculative decoding."""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from loragw.gateway.app import create_app
from loragw.gateway.common.config import ServerConfig
from loragw.gateway.common.flags import add_options
from loragw.gateway.server import BackgroundServer

PROMPTS = ["Once upon a time", "The quick brown fox", "In a hole in the ground", "Hello"]
MODELS = ["demo-base", "lora-1", "lora-2", "lora-1"]


@pytest.fixture(scope="module")
def async_server(server_config, tmp_path_factory):
    config = ServerConfig(**{**server_config.__dict__,
                             "adapter_dir": str(tmp_path_factory.mktemp("async-store")),
                             "async_scheduling": True})
    app = create_app(config)
    with BackgroundServer(app) as background:
        background.services = app.state.services
        background.wait_ready()
        yield background


def test_flag_and_environment_reach_the_engine(tmp_path):
    parser = add_options(argparse.ArgumentParser(), ServerConfig, {})
    config = ServerConfig.from_args(parser.parse_args(["--model", str(tmp_path),
                                                       "--async-scheduling"]))
    assert config.async_scheduling and config.engine_options()["async_scheduling"]
    parser = add_options(argparse.ArgumentParser(), ServerConfig,
                         {"LORAGW_ASYNC_SCHEDULING": "true"})
    assert ServerConfig.from_args(parser.parse_args(["--model", str(tmp_path)])).async_scheduling
    with pytest.raises(ValueError, match="async-scheduling cannot be combined"):
        ServerConfig(model=str(tmp_path), async_scheduling=True,
                     speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')


def test_concurrent_and_streamed_outputs_equal_the_synchronous_engine(async_server, offline):
    from loragw.engine import SamplingParams

    client = openai.OpenAI(base_url=async_server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    adapters = [None if m == "demo-base" else m for m in MODELS]
    want = offline.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0.0,
                                                    ignore_eos=True), adapters)

    def complete(i: int) -> str:
        return client.completions.create(model=MODELS[i], prompt=PROMPTS[i], max_tokens=20,
                                         temperature=0.0, extra_body={"ignore_eos": True}
                                         ).choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # in one batch, as the offline run was
        got = list(pool.map(complete, range(len(PROMPTS))))
    assert got == [o.text for o in want]
    stream = client.completions.create(model=MODELS[1], prompt=PROMPTS[1], max_tokens=20,
                                       temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream) == want[1].text

    # A stop string ends the text where it does without the flag (a token already in flight
    # past it is dropped).
    stop = want[0].text[6:9]
    ref = offline.generate([PROMPTS[0]], SamplingParams(max_tokens=20, temperature=0.0,
                                                        ignore_eos=True, stop=[stop]))[0]
    out = client.completions.create(model=MODELS[0], prompt=PROMPTS[0], max_tokens=20,
                                    temperature=0.0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert (out.text, out.finish_reason) == (ref.text, "stop")


def test_a_client_leaving_mid_stream_aborts_its_request(async_server, wait_idle):
    body = {"model": "lora-2", "prompt": "Once upon a time", "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=async_server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for n, _ in enumerate(r.iter_lines()):
                if n == 6:
                    break  # leave while tokens are being generated
        wait_idle(async_server.services)  # blocks, slot and the request released
        done = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 5})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 5
