"""Can this replica serve, and is its engine alive? `Readiness` says (what /ready, /health and
every route that needs the engine ask), and why not. `EngineWatchdog` pings the engine loop every PING_INTERVAL_S (a call
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

from loragw.engine.api import EngineClient, EngineDied
from loragw.gateway.common.errors import APIError

logger = logging.getLogger(__name__)
PING_INTERVAL_S = 1.0
ENGINE_PROBE_TIMEOUT_S = 10.0


class Readiness:
    """The replica's state: starting (`status` says what it loads), ready, or not any more (a
    dead engine names why). Services sets it; the routes only ask."""

    def __init__(self) -> None:
        self.ready = False
        self.status = "starting"
        self.engine: EngineClient | None = None
        self.watchdog: EngineWatchdog | None = None  # pings the engine once it runs
        self.engine_death: str | None = None  # why the engine exited, once it has

    def check_ready(self) -> None:
        if not self.ready:
            raise APIError.not_ready(self.status)

    def died(self, why: str) -> None:
        self.ready, self.status, self.engine_death = False, why, why

    def check_alive(self) -> None:
        """/health: 503 once the engine has died (naming why: a tensor-parallel rank names
        itself) or has not answered the watchdog's ping within --health-timeout-s."""
        if self.engine_death is not None:
            raise APIError.engine_gone(self.engine_death)
        stuck = self.watchdog.stuck() if self.watchdog is not None else None
        if stuck is not None:
            raise APIError.engine_gone(stuck, code="engine_unresponsive")

    async def probe(self, timeout: float = ENGINE_PROBE_TIMEOUT_S) -> None:
        """/ready: loaded, and the engine loop answers between two steps within `timeout`."""
        self.check_ready()
        # shield: a timed-out probe must not cancel the call the engine will still answer
        answered = asyncio.shield(self.engine.probe())
        try:
            await asyncio.wait_for(answered, timeout)
        except TimeoutError:
            raise APIError.not_ready(f"the engine loop has not answered in {timeout:.0f} s "
                                     "(wedged, or one step is that slow)") from None
        except EngineDied as exc:  # it died while we asked: the death handler runs next
            raise APIError.engine_gone(str(exc)) from None


class EngineWatchdog:
    def __init__(self, engine: EngineClient, timeout_s: float):
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
            except RuntimeError:  # the engine died: Services' death handler reports it
                logger.info("engine watchdog: the engine is gone; no more pings")
                return
            self._ping_sent_at, self.answered_at = None, time.monotonic()
            await asyncio.sleep(PING_INTERVAL_S)
