"""`loragw serve --tensor-parallel-size 2` on the CPU (gloo): an adapter uploaded through the
admin API serves what the one-device offline engine gives, and SIGKILL of the second rank
mid-stream ends the stream with an error event and the server with a non-zero status within
seconds, instead of hanging in a collective."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from loragw.engine import SamplingParams
from loragw.gateway.bench.server import free_port, wait_ready

pytestmark = pytest.mark.slow  # two ranks per server

REPO = Path(__file__).resolve().parents[2]
PROMPT = "Once upon a time"
STOP_S = 10.0  # SIGTERM, then this long to exit, then SIGKILL


@pytest.fixture
def tp2_server(model_dir, tmp_path) -> Iterator[tuple[subprocess.Popen, str]]:
    """(process, url) of `python -P -m loragw.gateway.server --tensor-parallel-size 2`, ready, logging to
    tmp_path/server.log. It leads a process group of its own, and on every way out (a failed
    assert, a timeout, a start-up that never got ready) that group and every process the server
    started are stopped and the log is closed."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "server.log", "w+b") as log:
        server = subprocess.Popen(
            [sys.executable, "-P", "-m", "loragw.gateway.server", "--model", model_dir, "--device", "cpu",
             "--max-model-len", "512", "--port", str(port), "--adapter-dir", str(tmp_path / "s"),
             "--tensor-parallel-size", "2"],
            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(url, server, log)
            yield server, url
        finally:
            stop_all(server)


def stop_all(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, then SIGKILL to whatever is left of the group or
    of the server's descendants (the engine process, its tensor-parallel ranks) after STOP_S."""
    left = started_by(server)
    if server.poll() is None:  # alive: its group id is still its own
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    for proc in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(left, timeout=STOP_S)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=STOP_S)


def started_by(server: subprocess.Popen) -> list[psutil.Process]:
    """The server's descendants and the other members of its process group (a rank whose parent
    died is no longer a descendant, but still in the group)."""
    found: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.NoSuchProcess):
        found |= {p.pid: p for p in psutil.Process(server.pid).children(recursive=True)}
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if proc.pid != server.pid and os.getpgid(proc.pid) == server.pid:
                found.setdefault(proc.pid, proc)
    return list(found.values())


def test_tp2_serves_uploads_and_dies_cleanly_with_a_rank(tp2_server, model_dir, adapter_dirs,
                                                         offline, tmp_path):
    name, folder = next(iter(adapter_dirs.items()))
    server, url = tp2_server
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

    reader = threading.Thread(target=stream, daemon=True)
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
