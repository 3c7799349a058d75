"""The server `loragw bench` measures when it is given no --url: `loragw serve` in a subprocess
(in the benchmark's own process the two would share a GIL, and the numbers would partly be the
client's), ready before the first request and stopped when the benchmark ends."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

import httpx

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
READY_TIMEOUT_S = 900.0  # --demo trains the demo adapters on first use: minutes on a CPU
STOP_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 15


class ServerStartError(Exception):
    """The server exited or never became ready; the message carries its last log lines."""


def free_port() -> int:
    """A loopback TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@contextmanager
def serve_subprocess(serve_args: list[str], api_key: str | None = None) -> Iterator[str]:
    """`loragw serve --host 127.0.0.1 --port <free> *serve_args` for the length of the block;
    yields its URL once /ready answers 200. Its log goes to a temporary file, shown only if it
    fails to start; the API key travels in the environment, out of `ps`."""
    port = free_port()
    url = f"http://{HOST}:{port}"
    # -P: the working directory stays off sys.path (see engine.core.spawn)
    argv = [sys.executable, "-P", "-m", "loragw.gateway.cli", "serve", "--host", HOST,
            "--port", str(port), *serve_args]
    env = os.environ | ({"LORAGW_API_KEY": api_key} if api_key else {})
    logger.info("starting `loragw serve %s`", " ".join(argv[5:]))
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=log, env=env)
        try:
            wait_ready(url, proc, log)
            yield url
        finally:
            stop_server(proc)


def stop_server(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM (the server's graceful shutdown), then SIGKILL if it is not gone by `timeout`."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_ready(url: str, proc: subprocess.Popen, log: IO[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            raise ServerStartError(f"the server exited with status {proc.returncode} during "
                                   "start-up; its last log lines:\n" + "\n".join(tail))
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.2)
    raise ServerStartError(f"the server at {url} was not ready after {READY_TIMEOUT_S:.0f} s")
