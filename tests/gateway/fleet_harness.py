"""A fleet on loopback, as production runs one: `python -P -m loragw.gateway.server` replica processes on
one real redis-server (and, when given, one real S3 server), started with no --adapter flags:
every adapter arrives through the admin API of whichever replica a test picks.

    fleet = Fleet(workdir, model_dir, redis_server, s3=s3_server)
    fleet.start("r1", "r2", "r3")
    fleet.upload("r1", "sql", folder)         # the admin API, multipart
    fleet.complete("r2", "sql")               # the OpenAI API; X-Served-By says who served it
    fleet.kill("r1"); fleet.start("r1", empty_disk=True)

`running_fleet(workdir, model_dir, "r1", "r2", s3=...)` does the same with a redis-server of its
own, and stops both on the way out (a test module's fixture).

A fleet a module's tests share is shared state: each test asks for what it needs and makes it
when missing (`fleet.ensure_adapter`), and `fleet.revive(...)` brings back, before the next test,
the replicas and the Redis an earlier test took down, so any test passes alone and in any order.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import redis
from uploads import read_files

from loragw.adapters.registry import ReplicaState, decode_state
from loragw.gateway.bench.server import free_port
from loragw.gateway.fleet.router import FORWARDED_HEADER

REPO = Path(__file__).resolve().parents[2]
KEY = "fleet-key"
SLOTS = 3
START_TIMEOUT_S = 150.0
PROMPT = "The quick brown fox"


def load_fixture_module(name: str):
    """tests/adapters/<name>.py (tests/adapters is not a package, and `adapters` is ours),
    once per process under its own name, as its own tests import it."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).parent.parent / "adapters" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


redis_fixture = load_fixture_module("redis_server")


class Fleet:
    def __init__(self, workdir: Path, model_dir: str, redis_server, s3=None,
                 store_url: str | None = None, extra: tuple[str, ...] = ()):
        self.workdir, self.model_dir, self.redis_server = workdir, model_dir, redis_server
        self.s3, self.store_url, self.extra = s3, store_url, extra
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}
        self.logs: dict[str, object] = {}
        self.http = httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"})
        self.redis = redis.Redis.from_url(redis_server.url)
        self._prefix: str | None = None  # the registry's, once a replica has joined (prefix())

    # ---- replicas ------------------------------------------------------------------------
    def start(self, *rids: str, empty_disk: bool = False, env_changes: dict | None = None,
              wait: bool = True) -> None:
        """Start replicas (again, on the same port, after a kill) and wait until ready."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               **(self.s3.env if self.s3 is not None else {}), **(env_changes or {})}
        for rid in rids:
            disk = self.workdir / f"{rid}-store"
            if empty_disk:
                shutil.rmtree(disk, ignore_errors=True)
            self.urls.setdefault(rid, f"http://127.0.0.1:{free_port()}")
            port = self.urls[rid].rsplit(":", 1)[1]
            store = ["--adapter-store-url", self.store_url] if self.store_url else []
            if rid in self.logs:  # a restart: the log goes on in the same file
                self.logs[rid].close()
            self.logs[rid] = open(self.workdir / f"{rid}.log", "ab")
            self.procs[rid] = subprocess.Popen(
                [sys.executable, "-P", "-m", "loragw.gateway.server", "--model", self.model_dir,
                 "--served-model-name", "demo-base", "--device", "cpu",
                 "--max-model-len", "256", "--max-num-seqs", "4", "--max-loras", str(SLOTS),
                 "--port", port, "--redis-url", self.redis_server.url, "--replica-id", rid,
                 "--advertise-url", self.urls[rid], "--api-key", KEY,
                 "--adapter-dir", str(disk), *store, *self.extra],
                cwd=REPO, env=env, stdout=self.logs[rid], stderr=subprocess.STDOUT)
        if not wait:
            return
        deadline = time.monotonic() + START_TIMEOUT_S
        for rid in rids:
            while not self._ready(rid):
                assert self.procs[rid].poll() is None, f"replica {rid} exited:\n{self.log(rid)}"
                assert time.monotonic() < deadline, f"replica {rid} never became ready"
                time.sleep(0.2)
        self.wait_for("the replicas in the registry", lambda: set(rids) <= set(self.states()))

    def _ready(self, rid: str) -> bool:
        try:
            return self.http.get(self.urls[rid] + "/ready").status_code == 200
        except httpx.TransportError:
            return False

    def kill(self, rid: str) -> None:
        """SIGKILL: no deregistration; only the heartbeat stops."""
        self.procs[rid].kill()
        self.procs[rid].wait(timeout=10)

    def retire(self, rid: str) -> None:
        """SIGTERM: `rid` leaves the registry at once, as a scale-down takes a replica away."""
        self.procs[rid].send_signal(signal.SIGTERM)
        try:
            self.procs[rid].wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill(rid)

    def revive(self, *rids: str) -> None:
        """Bring back what an earlier test took down and left down: Redis (empty, as a restart
        leaves it; the replicas write back what they know) and each of `rids` whose process
        has exited (on its own disk, on its own port)."""
        if not self.redis_server.running:
            self.redis_server.start()
        if dead := [rid for rid in rids if self.procs[rid].poll() is not None]:
            self.start(*dead)

    def alive(self) -> list[str]:
        """The replicas whose process is alive."""
        return [rid for rid, proc in self.procs.items() if proc.poll() is None]

    def log(self, rid: str) -> str:
        return (self.workdir / f"{rid}.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in self.logs.values():
            log.close()
        self.http.close()

    # ---- the registry --------------------------------------------------------------------
    def prefix(self) -> str | None:
        """The fleet's registry prefix, loragw:<base key>: (one catalog per base model); None
        until a replica has joined. It never changes, so it outlives a Redis restart."""
        if self._prefix is None:
            found = {k.decode().removesuffix("epoch") for k in self.redis.keys("loragw:*:epoch")}
            assert len(found) <= 1, f"expected one base model's registry in Redis, found {found}"
            self._prefix = found.pop() if found else None
        return self._prefix

    def states(self) -> dict[str, ReplicaState]:
        out = {}
        if self.prefix() is None:
            return out  # no replica has joined yet
        for rid in list(self.urls):
            raw = self.redis.get(f"{self.prefix()}replica:{rid}")
            if raw is not None:
                out[rid] = decode_state(raw)
        return out

    def catalog(self) -> set[str]:
        prefix = self.prefix()
        return {k.decode() for k in self.redis.hkeys(f"{prefix}catalog")} if prefix else set()

    @staticmethod
    def wait_for(what: str, predicate, timeout: float = 20.0) -> float:
        started = time.monotonic()
        while not predicate():
            assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
            time.sleep(0.1)
        return time.monotonic() - started

    # ---- the APIs ------------------------------------------------------------------------
    def complete(self, rid: str, model: str, marker: str | None = None, prompt: str = PROMPT,
                 **extra) -> httpx.Response:
        """POST /v1/completions on `rid`; `marker` makes it serve the request itself."""
        headers = {FORWARDED_HEADER: marker} if marker else {}
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
        return self.http.post(self.urls[rid] + "/v1/completions", json=body, headers=headers)

    def text(self, rid: str, model: str, marker: str | None = None, **extra) -> str:
        response = self.complete(rid, model, marker, **extra)
        assert response.status_code == 200, (rid, model, response.text)
        return response.json()["choices"][0]["text"]

    def upload(self, rid: str, adapter_id: str, folder, replace: bool = False) -> httpx.Response:
        config, weights = read_files(folder)
        return self.http.post(self.urls[rid] + "/admin/adapters",
                              data={"adapter_id": adapter_id, "replace": str(replace).lower()},
                              files={"adapter_config": ("adapter_config.json", config),
                                     "adapter_model": ("adapter_model.safetensors", weights)})

    def register(self, rid: str, adapter_id: str, source: str,
                 replace: bool = False) -> httpx.Response:
        return self.http.post(self.urls[rid] + "/admin/adapters/register",
                              json={"adapter_id": adapter_id, "source": source,
                                    "replace": replace})

    def ensure_adapter(self, rid: str, adapter_id: str, folder, register: bool = False) -> None:
        """`adapter_id` in the catalog, added through `rid` (uploaded, or registered from the path
        `folder`) unless `rid` lists it already; listed by every running replica on return."""
        if adapter_id not in self.models(rid):
            add = self.register(rid, adapter_id, str(folder)) if register else self.upload(
                rid, adapter_id, folder)
            assert add.status_code == 201, (rid, adapter_id, add.text)
        self.wait_for(f"every replica to list {adapter_id}", lambda: all(
            adapter_id in self.models(other) for other in self.alive()), timeout=3)

    def delete(self, rid: str, adapter_id: str) -> httpx.Response:
        return self.http.delete(self.urls[rid] + f"/admin/adapters/{adapter_id}")

    def models(self, rid: str) -> dict[str, dict]:
        response = self.http.get(self.urls[rid] + "/v1/models")
        assert response.status_code == 200, response.text
        return {card["id"]: card for card in response.json()["data"]}

    def admin(self, rid: str) -> dict[str, dict]:
        response = self.http.get(self.urls[rid] + "/admin/adapters")
        assert response.status_code == 200, response.text
        return {info["id"]: info for info in response.json()["data"]}


@contextmanager
def running_fleet(workdir: Path, model_dir: str, *rids: str, fleet_type: type[Fleet] = Fleet,
                  **options) -> Iterator[Fleet]:
    """A `fleet_type` (options: its constructor's s3, store_url, extra, ...) on a redis-server
    of its own, with the replicas `rids` started and ready; replicas and Redis are stopped on
    the way out."""
    redis_server = redis_fixture.RedisServer(workdir)
    redis_server.start()
    fleet = fleet_type(workdir, model_dir, redis_server, **options)
    try:
        fleet.start(*rids)
        yield fleet
    finally:
        fleet.stop()
        redis_server.kill()


def served_by(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.headers["x-served-by"]
