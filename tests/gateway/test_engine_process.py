"""The engine in a process of its own (engine/core/): `loragw serve`'s default. The other
gateway tests run against it; here, what only a process can do: die. SIGKILL of the engine
process mid-stream ends every open stream with an error event (logged and counted as a 500),
takes /ready down, and the server exits non-zero within a few seconds instead of hanging. And
`--engine-cpus`: the engine process on the CPUs named, the HTTP server on the others."""

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
import pytest

from loragw.gateway.bench.server import free_port, wait_ready
from loragw.gateway.common.config import ServerConfig, parse_cpu_list

REPO = Path(__file__).resolve().parents[2]


def test_engine_cpus_are_a_cpu_list_this_process_may_use(model_dir):
    assert parse_cpu_list("0-2,5, 7-7") == {0, 1, 2, 5, 7}
    for bad in ("", "a", "3-1", "-1", "0,,1"):
        with pytest.raises(ValueError, match="--engine-cpus"):
            parse_cpu_list(bad)
    allowed = max(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="may not use"):
        ServerConfig(model=model_dir, engine_cpus=f"{allowed + 1}")
    with pytest.raises(ValueError, match="drop --no-engine-process"):
        ServerConfig(model=model_dir, engine_cpus="0", engine_process=False)
    assert ServerConfig(model=model_dir, engine_cpus=f"{allowed}").engine_cpu_set() == {allowed}


def test_a_killed_engine_process_ends_every_stream_and_the_server(model_dir, tmp_path):
    # On the engine's own CPU when there are two: --engine-cpus is checked on the way.
    cpus = sorted(os.sched_getaffinity(0))
    pin = ["--engine-cpus", str(cpus[0])] if len(cpus) > 1 else []
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w+b")
    server = subprocess.Popen(
        [sys.executable, "-P", "-m", "loragw.gateway.server", "--model", model_dir, "--device", "cpu",
         "--max-model-len", "512", "--port", str(port), "--adapter-dir", str(tmp_path / "s"),
         *pin],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
        stderr=subprocess.STDOUT)
    try:
        wait_ready(url, server, log)
        (engine,) = psutil.Process(server.pid).children()
        if pin:
            for thread in engine.threads():
                assert os.sched_getaffinity(thread.id) == {cpus[0]}
            for thread in psutil.Process(server.pid).threads():
                assert os.sched_getaffinity(thread.id) == set(cpus[1:])
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
        text = (tmp_path / "server.log").read_text()
        assert "engine process exited" in text
        # each cut-short stream is logged (and counted) as the server error it is, not a 200
        streams = [line for line in access_lines(text) if line["route"] == "/v1/completions"]
        assert [line["status"] for line in streams] == [500, 500], streams
    finally:
        if server.poll() is None:
            server.kill()
        log.close()


def access_lines(log: str) -> list[dict]:
    """The server's access-log lines (logger loragw.gateway.access: one JSON object each)."""
    marker = " loragw.gateway.access: "
    return [json.loads(line.split(marker, 1)[1]) for line in log.splitlines() if marker in line]


def test_an_unsupported_architecture_fails_at_start_named(model_dir, tmp_path):
    # A DeepSeek-V3 config.json over the demo's files: refused before any weight is read, with
    # the architecture and the supported list, and no stack trace.
    model = tmp_path / "deepseek"
    model.mkdir()
    for name in os.listdir(model_dir):
        (model / name).symlink_to(os.path.join(model_dir, name))
    (model / "config.json").unlink()
    config = json.loads(Path(model_dir, "config.json").read_text())
    config |= {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    (model / "config.json").write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, "-P", "-m", "loragw.gateway.server", "--model", str(model), "--device", "cpu",
         "--port", "0", "--adapter-dir", str(tmp_path / "s")],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "'DeepseekV3ForCausalLM' is not supported; supported: LlamaForCausalLM" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
