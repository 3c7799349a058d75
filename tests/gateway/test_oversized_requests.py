"""One request must never wedge the server. What an attacker with an API key sends (a 3 MB chat
message, 500,000 prompt token ids, a 100,000-entry logit_bias, 300,000 allowed_token_ids) and
what a long-context user sends (a 100,000-token prompt), repeatedly and concurrently with normal
traffic, against `loragw serve` with the engine in its own process and on a thread: the big ones
get their 400 or are served, every normal request is answered with the text it gets alone, and
the server stays healthy. Then the engine stops answering (its process stopped, a step that
never returns on the thread) while frames larger than the socket buffer queue up behind it:
/health turns 503 within --health-timeout-s, and once the engine runs again every queued request
is served whole (a torn frame would garble or lose them)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

from loragw.gateway.app import create_app
from loragw.gateway.bench.server import free_port, stop_server, wait_ready
from loragw.gateway.common.config import ServerConfig
from loragw.gateway.server import BackgroundServer

REPO = Path(__file__).resolve().parents[2]
CONTEXT = 131_072
HEALTH_TIMEOUT_S = 2.0
# A sliding window keeps a 100k-token prefill linear (and its KV cache to a few blocks).
MODEL = dict(max_position_embeddings=CONTEXT, sliding_window=128)
SERVE = ["--device", "cpu", "--max-model-len", str(CONTEXT), "--num-kv-blocks", "256",
         "--max-num-batched-tokens", "512", "--health-timeout-s", str(HEALTH_TIMEOUT_S)]
NORMAL = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}


def attacks(model: str) -> list[tuple[str, dict, int, str | None]]:
    """(route, body, status, the param a 400 names) of each oversized request."""
    ids = random.Random(0).choices(range(10, 500), k=100_000)
    return [
        ("/v1/chat/completions", {"model": model, "max_tokens": 4, "messages": [
            {"role": "user", "content": "lorem ipsum " * 262_144}]}, 400, "max_tokens"),
        ("/v1/completions", {"model": model, "prompt": [7] * 500_000, "max_tokens": 4},
         400, "max_tokens"),
        ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4,
                             "logit_bias": {str(i): 1 for i in range(100_000)}},
         400, "logit_bias"),
        ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4,
                             "allowed_token_ids": list(range(300_000))},
         400, "allowed_token_ids"),
        ("/v1/completions", {"model": model, "prompt": ids, "max_tokens": 1}, 200, None),
    ]


@pytest.fixture(scope="module")
def long_model(tiny_checkpoint) -> str:
    return tiny_checkpoint("mistral", **MODEL)


@contextmanager
def serving(model: str, tmp_path: Path, *extra: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`loragw serve` on the long-context model, ready, stopped however the block ends."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w+b")
    server = subprocess.Popen(
        [sys.executable, "-P", "-m", "loragw.gateway.server", "--model", model, "--port", str(port),
         "--adapter-dir", str(tmp_path / "store"), *SERVE, *extra],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, server, log)
        yield server, url
    finally:
        stop_server(server)
        log.close()


def normal_text(http: httpx.Client, model: str) -> str:
    got = http.post("/v1/completions", json={"model": model, **NORMAL})
    assert got.status_code == 200, got.text
    return got.json()["choices"][0]["text"]


def hammer(url: str, model: str, rounds: int = 2) -> None:
    """Every attack `rounds` times at once with a steady stream of normal requests; each
    answered as it should be, normal ones with the text they get alone."""
    with httpx.Client(base_url=url, timeout=300) as http:
        alone = normal_text(http, model)
        stop = threading.Event()
        normals: list[str] = []

        def normal_traffic() -> None:
            while not stop.is_set():
                normals.append(normal_text(http, model))

        def attack(route: str, body: dict, status: int, param: str | None) -> None:
            got = http.post(route, json=body)
            assert got.status_code == status, (route, got.status_code, got.text[:300])
            if param is not None:
                assert got.json()["error"]["param"] == param, got.text[:300]

        with ThreadPoolExecutor(8) as pool:
            background = [pool.submit(normal_traffic) for _ in range(2)]
            sent = [pool.submit(attack, *a) for a in attacks(model) * rounds]
            for future in sent:
                future.result()
            stop.set()
            for future in background:
                future.result()
        assert normals and set(normals) == {alone}
        assert http.get("/health").status_code == 200
        assert http.get("/ready").status_code == 200
        assert normal_text(http, model) == alone


def test_oversized_requests_never_wedge_the_engine_process(long_model, tmp_path):
    model = os.path.basename(long_model)
    with serving(long_model, tmp_path) as (server, url):
        hammer(url, model)
        # The engine stops (SIGSTOP): /health says so within its bound while requests whose
        # frames outgrow the socket buffer queue up; SIGCONT: every one is served whole.
        (engine,) = psutil.Process(server.pid).children()
        stops = [f"{i}:" + "~" * 4000 for i in range(64)]  # ~260 KB a frame, cheap to serve
        body = {"model": model, **NORMAL, "stop": stops}
        with httpx.Client(base_url=url, timeout=300) as http:
            want = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
            with ThreadPoolExecutor(16) as pool:  # (its exit waits for every request)
                engine.send_signal(signal.SIGSTOP)
                stopped = time.monotonic()
                try:
                    queued = [pool.submit(http.post, "/v1/completions", json=body)
                              for _ in range(16)]
                    while (health := http.get("/health")).status_code == 200:
                        assert time.monotonic() - stopped < HEALTH_TIMEOUT_S + 5
                        time.sleep(0.1)
                    assert health.status_code == 503
                    assert "has not answered a ping" in health.json()["error"]["message"]
                    assert health.json()["error"]["code"] == "engine_unresponsive"
                finally:
                    engine.send_signal(signal.SIGCONT)
                for future in queued:
                    got = future.result()
                    assert got.status_code == 200, got.text[:300]
                    assert got.json()["choices"][0]["text"] == want
            deadline = time.monotonic() + 10
            while http.get("/health").status_code != 200:
                assert time.monotonic() < deadline, "/health never recovered"
                time.sleep(0.1)
            assert normal_text(http, model)


def test_oversized_requests_never_wedge_the_thread_engine(long_model, tmp_path):
    with serving(long_model, tmp_path, "--no-engine-process") as (_, url):
        hammer(url, os.path.basename(long_model))


def test_health_fails_within_its_bound_while_a_thread_engine_step_never_returns(
        long_model, tmp_path):
    config = ServerConfig(model=long_model, device="cpu", max_model_len=2048,
                          adapter_dir=str(tmp_path / "store"), engine_process=False,
                          health_timeout_s=HEALTH_TIMEOUT_S)
    app = create_app(config)
    with BackgroundServer(app) as background, httpx.Client(base_url=background.url,
                                                           timeout=300) as http:
        deadline = time.monotonic() + 120
        while http.get("/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        engine = app.state.services.engine.transport.engine  # the LLMEngine the thread steps
        release, step = threading.Event(), engine.step

        def stuck_step():
            release.wait()
            return step()

        engine.step = stuck_step
        try:
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(normal_text, http, os.path.basename(long_model))
                started = time.monotonic()
                while (health := http.get("/health")).status_code == 200:
                    assert time.monotonic() - started < HEALTH_TIMEOUT_S + 5
                    time.sleep(0.1)
                assert health.json()["error"]["code"] == "engine_unresponsive"
                release.set()
                assert waiting.result()  # the step returns: the request is served
        finally:
            engine.step = step
            release.set()
        deadline = time.monotonic() + 10
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "/health never recovered"
            time.sleep(0.1)
