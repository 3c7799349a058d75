"""A real ``redis-server`` on a free loopback port, as a pytest fixture other test modules reuse.

The server runs without persistence (``--save '' --appendonly no``), so ``restart()`` brings it
back on the same port *empty*, the way a Redis pod without a volume comes back. Tests never skip
for want of the binary: CI installs it, and a missing one fails with what to install.

    from redis_server import redis_server          # a test module in tests/adapters
    async def test_x(redis_server):
        client = redis.asyncio.Redis.from_url(redis_server.url)
        redis_server.kill(); redis_server.restart()
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loragw.gateway.bench.server import free_port

REDIS_SERVER_BIN = "/usr/bin/redis-server"
START_TIMEOUT_S = 10.0


def find_redis_server() -> str:
    """Path of the redis-server binary; fails the test (never skips) when it is not installed."""
    found = shutil.which("redis-server") or (
        REDIS_SERVER_BIN if Path(REDIS_SERVER_BIN).exists() else None
    )
    if found is None:
        pytest.fail(
            "redis-server is not installed; the registry tests need a real Redis: "
            "install it with `apt-get install redis-server` (CI installs it too)",
            pytrace=False,
        )
    return found


def _pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process on 127.0.0.1; ``kill()`` and ``restart()`` keep the port."""

    def __init__(self, workdir: Path, binary: str | None = None) -> None:
        self.workdir = workdir
        self.binary = binary or find_redis_server()
        self.port = free_port()
        self.log_path = workdir / "redis.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        assert not self.running, "redis-server is already running"
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            str(self.log_path),
            "--loglevel",
            "warning",
        ]
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _pings(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                log = (
                    self.log_path.read_text(errors="replace")[-2000:]
                    if self.log_path.exists()
                    else ""
                )
                raise RuntimeError(
                    f"redis-server on port {self.port} did not answer PING within "
                    f"{START_TIMEOUT_S:.0f} s; its log ({self.log_path}):\n{log}"
                )
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing saved, clients see connections drop)."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None

    def restart(self) -> None:
        """Kill if running, then start again on the same port with no data."""
        self.kill()
        self.start()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A running, empty redis-server for one test; ``.url`` is ``redis://127.0.0.1:N/0``."""
    server = RedisServer(tmp_path)
    try:
        server.start()
    except RuntimeError:  # the port was taken between picking and binding: pick another once
        server.port = free_port()
        server.start()
    try:
        yield server
    finally:
        server.kill()
