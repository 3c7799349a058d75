"""`loragw serve --tensor-parallel-size 2` on the CPU (gloo): an adapter uploaded through the
admin API serves what the one-device offline engine gives, and SIGKILL of the second rank
mid-stream ends the stream with an error event and the server with a non-zero status within
seconds, instead of hanging in a collective."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
from fleet_harness import redis_fixture

from engine import SamplingParams
from gateway.bench.server import wait_ready

REPO = Path(__file__).resolve().parents[2]
PROMPT = "Once upon a time"


def start(model_dir: str, tmp_path: Path) -> tuple[subprocess.Popen, str]:
    port = redis_fixture.free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w+b")
    server = subprocess.Popen(
        [sys.executable, "-m", "gateway.server", "--model", model_dir, "--device", "cpu",
         "--max-model-len", "512", "--port", str(port), "--adapter-dir", str(tmp_path / "s"),
         "--tensor-parallel-size", "2"],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
        stderr=subprocess.STDOUT)
    with log:
        wait_ready(url, server, log)
    return server, url


def test_tp2_serves_uploads_and_dies_cleanly_with_a_rank(model_dir, adapter_dirs, offline,
                                                         tmp_path):
    name, folder = next(iter(adapter_dirs.items()))
    server, url = start(model_dir, tmp_path)
    try:
        files = {part: (filename, (Path(folder) / filename).read_bytes()) for part, filename in
                 (("adapter_config", "adapter_config.json"),
                  ("adapter_model", "adapter_model.safetensors"))}
        uploaded = httpx.post(url + "/admin/adapters", data={"adapter_id": "tp-upload"},
                              files=files, timeout=60)
        assert uploaded.status_code in (200, 201), uploaded.text
        params = SamplingParams(max_tokens=16, temperature=0.0)
        for model, adapter in ((os.path.basename(model_dir), None), ("tp-upload", name)):
            body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
            got = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert got.status_code == 200, got.text
            (want,) = offline.generate([PROMPT], params, adapters=[adapter])
            assert got.json()["choices"][0]["text"] == want.text, model

        engine = psutil.Process(server.pid).children()[0]
        (rank1,) = [p for p in engine.children() if "spawn_main" in " ".join(p.cmdline())]
        events: list[str] = []
        streaming = threading.Event()

        def stream() -> None:
            body = {"model": "tp-upload", "prompt": PROMPT, "max_tokens": 400,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 3:
                            streaming.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert streaming.wait(timeout=60)
        rank1.kill()
        killed = time.monotonic()
        reader.join(timeout=30)
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert "tensor-parallel rank 1 exited" in error["message"], error
        try:  # once the engine process is gone both probes say why (503, never a 500), while
            # the server still answers
            while (health := httpx.get(url + "/health")).status_code == 200:
                assert httpx.get(url + "/ready").status_code in (200, 503)
                time.sleep(0.05)
            assert health.status_code == 503
            assert "tensor-parallel rank 1 exited" in health.json()["error"]["message"]
            ready = httpx.get(url + "/ready")
            assert ready.status_code == 503
            assert "tensor-parallel rank 1 exited" in ready.json()["error"]["message"]
        except httpx.TransportError:
            pass
        assert server.wait(timeout=30) != 0
        assert time.monotonic() - killed < 30
        log = (tmp_path / "server.log").read_text()
        assert "the engine process exited (status 1): engine step failed: tensor-parallel " \
               "rank 1 exited (exit code -9)" in log, log[-2000:]
    finally:
        if server.poll() is None:
            server.kill()
