"""Is the engine alive? `EngineWatchdog` pings the engine loop every PING_INTERVAL_S (a call
it answers between two steps, on its thread or in its process) and remembers when it last
answered, so /health (liveness) can say at once, without a wait of its own, that the engine has
been silent for longer than --health-timeout-s: a step that never returns, or a process that
stopped, is then restarted by Kubernetes' liveness probe instead of serving nothing forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

logger = logging.getLogger(__name__)
PING_INTERVAL_S = 1.0


class EngineWatchdog:
    def __init__(self, engine, timeout_s: float):
        self.engine, self.timeout_s = engine, timeout_s
        self.answered_at = time.monotonic()
        self._ping_sent_at: float | None = None  # the ping in flight, if any
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def silent_for(self) -> float:
        """Seconds the ping in flight has waited (0 when none is waiting)."""
        sent = self._ping_sent_at
        return 0.0 if sent is None else time.monotonic() - sent

    def stuck(self) -> str | None:
        """Why the engine counts as stuck, or None while it answers within the bound."""
        silent = self.silent_for
        if silent <= self.timeout_s:
            return None
        return (f"the engine loop has not answered a ping for {silent:.0f} s (bound: "
                f"--health-timeout-s {self.timeout_s:g}); it is wedged, or one step runs that "
                "long")

    async def _watch(self) -> None:
        while True:
            self._ping_sent_at = time.monotonic()
            try:
                await self.engine.probe()
            except RuntimeError:  # the engine died: the runtime's death handler reports it
                logger.info("engine watchdog: the engine is gone; no more pings")
                return
            self._ping_sent_at, self.answered_at = None, time.monotonic()
            await asyncio.sleep(PING_INTERVAL_S)
