"""The family models of a test session, trained on first use, and `loragw serve` of each, started
START_AHEAD families ahead: while one family's tests run (a few seconds), the next families'
models are trained and their servers start. A start is mostly imports and the engine process's
start-up, 15-25 s of one core each, so two at once keep the 2-core machine busy.

    models = FamilyModels(root)                       models["qwen3"] -> a FamilyModel
    servers = FamilyServers(models, root, ["qwen3", "magistral", "gemma3"])
    served = servers.take("qwen3")                    ready; the next two are starting
    servers.stop("qwen3"); servers.close()
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from chat_families import FAMILIES
from family_models import MAX_MODEL_LEN, FamilyModel, train_family_model

from loragw.gateway.bench.server import free_port, wait_ready

logger = logging.getLogger(__name__)
STOP_TIMEOUT_S = 30.0
START_AHEAD = 2  # servers starting while one is tested


class FamilyModels:
    """Family name -> its trained model, trained on first use, once per session. A model's
    directory is named after its family: the name the server serves it under."""

    def __init__(self, root: Path):
        self.root = root
        self.trained: dict[str, FamilyModel] = {}

    def __getitem__(self, name: str) -> FamilyModel:
        if name not in self.trained:
            self.trained[name] = train_family_model(FAMILIES[name], self.root / name)
        return self.trained[name]


@dataclass
class FamilyServer:
    model: FamilyModel
    url: str
    log_path: Path
    process: subprocess.Popen
    log: IO[bytes]
    started: float  # time.monotonic() at Popen

    @property
    def name(self) -> str:
        return self.model.family.name


def start_server(model: FamilyModel, work: Path, extra: tuple[str, ...] = ()) -> FamilyServer:
    """`loragw serve` of `model` on a free port, parsers on auto (their default), `extra`
    flags after; its log (the engine's included) goes to work/server.log."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = work / "server.log"
    log = open(log_path, "w+b")
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", "loragw.gateway.cli", "serve", "--model",
         str(model.directory), "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", str(MAX_MODEL_LEN), "--adapter-dir", str(work / "adapters"),
         *extra],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    return FamilyServer(model, f"http://127.0.0.1:{port}", log_path, process, log,
                        time.monotonic())


class FamilyServers:
    """Servers of the families in `order`, each started START_AHEAD takes before its own."""

    def __init__(self, models: FamilyModels, root: Path, order: list[str]):
        self.models = models
        self.root = root
        self.order = order
        self.running: dict[str, FamilyServer] = {}
        self.stopping: list[FamilyServer] = []

    def _start(self, name: str) -> FamilyServer:
        if name not in self.running:
            self.running[name] = start_server(self.models[name], self.root / f"serve-{name}")
        return self.running[name]

    def take(self, name: str) -> FamilyServer:
        """`name`'s server, ready; the next families' start meanwhile."""
        server = self._start(name)
        later = self.order[self.order.index(name) + 1:] if name in self.order else []
        for ahead in later[:START_AHEAD]:
            self._start(ahead)
        wait_ready(server.url, server.process, server.log)
        logger.info("%s: served after %.1f s", name, time.monotonic() - server.started)
        return server

    def stop(self, name: str) -> None:
        """Asks `name`'s server to stop; close() waits for it."""
        server = self.running.pop(name, None)
        if server is not None:
            server.process.terminate()
            self.stopping.append(server)

    def close(self) -> None:
        for name in list(self.running):
            self.stop(name)
        for server in self.stopping:
            try:
                server.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait()
            server.log.close()
        self.stopping.clear()
