"""Disk-tier reads off the step loop: an adapter whose host copy was evicted is re-read and
validated on a thread of its own while the engine keeps stepping; the sequence that needs it
waits (as for a slot) until its copy is in host memory, instead of every running stream waiting
through the read (tens of ms for a rank-16 all-linear adapter of a small model, far more for
large ones).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from loragw.adapters.format import LoraAdapter, read_adapter
from loragw.engine.lora.state import RegisteredAdapter


@dataclass(slots=True)
class _Read:
    version: int
    future: Future
    started: float  # time.perf_counter() when it was submitted


class HostReads:
    def __init__(self, spec):
        self.spec = spec  # what read_adapter validates against (the base's shapes)
        self._reads: dict[str, _Read] = {}
        self.failures: dict[str, str] = {}  # adapter -> why its read failed (take_failures)
        self._pool: ThreadPoolExecutor | None = None

    def take(self, name: str, entry: RegisteredAdapter) -> tuple[LoraAdapter, float] | None:
        """`name`'s adapter (`entry`: its version, and the disk copy read) once it has been
        read, with the seconds since its read started: None while the read runs (the first
        call starts it), and after it failed (see take_failures)."""
        version, path = entry.version, entry.path
        if name in self.failures:  # failed already: the engine fails its requests next
            return None
        read = self._reads.get(name)
        if read is not None and read.version != version:  # replaced since: read the new one
            read.future.cancel()
            read = None
        if read is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="adapter-read")
            self._reads[name] = _Read(version, self._pool.submit(read_adapter, path, self.spec,
                                                                entry.sha256),
                                      time.perf_counter())
            return None
        if not read.future.done():
            return None
        del self._reads[name]
        try:
            return read.future.result(), time.perf_counter() - read.started
        except Exception as exc:  # gone or corrupt on disk: its requests fail, nothing else
            self.failures[name] = f"adapter {name!r} could not be re-read from {path}: {exc}"
            return None

    def take_failures(self) -> dict[str, str]:
        """Adapters whose read failed since the last call, and why."""
        failures, self.failures = self.failures, {}
        return failures

    def forget(self, name: str) -> None:
        """Drop a read of an adapter that was removed or replaced."""
        read = self._reads.pop(name, None)
        if read is not None:
            read.future.cancel()

    def may_start(self, name: str, limit: int) -> bool:
        """Whether `name` has a read, or one may start with at most `limit` held at once
        (running, or done and not yet taken: the oldest done one is dropped to make room,
        since its request may have gone)."""
        if name in self._reads:
            return True
        for other in [n for n, r in self._reads.items() if r.future.done()]:
            if len(self._reads) < limit:
                break
            del self._reads[other]
        return len(self._reads) < limit

    @property
    def pending(self) -> bool:
        return any(not r.future.done() for r in self._reads.values())

    def wait(self, timeout: float) -> None:
        """Block until a read finishes or `timeout` seconds pass: a step that had nothing to
        run but reads to wait for does not spin the loop against the reading thread."""
        futures = [r.future for r in self._reads.values()]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._reads.clear()
