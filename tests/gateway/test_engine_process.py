"""The engine in a process of its own (engine/core/): `loragw serve`'s default. The other
gateway tests run against it; here, what only a process can do: die. SIGKILL of the engine
process mid-stream ends every open stream with an error event, takes /ready down, and the
server exits non-zero within a few seconds instead of hanging."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
from fleet_harness import redis_fixture

REPO = Path(__file__).resolve().parents[2]


def test_a_killed_engine_process_ends_every_stream_and_the_server(model_dir, tmp_path):
    port = redis_fixture.free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "gateway.server", "--model", model_dir, "--device", "cpu",
         "--max-model-len", "512", "--port", str(port), "--adapter-dir", str(tmp_path / "s")],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
        stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "the server never became ready"
            try:
                if httpx.get(url + "/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        (engine,) = psutil.Process(server.pid).children()
        body = {"model": os.path.basename(model_dir), "prompt": "Once upon a time",
                "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        events: list[list[str]] = [[], []]
        started = threading.Barrier(3)

        def stream(i: int) -> None:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                for n, line in enumerate(r.iter_lines()):
                    if line.startswith("data: "):
                        events[i].append(line[6:])
                    if n == 4:
                        started.wait()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        started.wait(timeout=60)  # both streams are generating
        engine.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(timeout=30)
        for got in events:
            assert got[-1] == "[DONE]", got[-3:]
            error = json.loads(got[-2])["error"]
            assert "engine process exited" in error["message"], error
        try:  # not ready any more, or gone already
            assert httpx.get(url + "/ready").status_code == 503
        except httpx.TransportError:
            pass
        assert server.wait(timeout=15) != 0
        assert time.monotonic() - killed < 15
        assert "engine process exited" in (tmp_path / "server.log").read_text()
    finally:
        if server.poll() is None:
            server.kill()
        log.close()
