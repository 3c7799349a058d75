"""The serving state behind the HTTP handlers: the engine, the adapters, the router, capacity
and readiness.

`Runtime.lifespan` is the Litestar lifespan: it loads the engine on a worker thread (so /health
answers and /ready says 503 while weights load), joins the registry, registers the --adapter
list, marks the runtime ready, and shuts everything down in `finally`. A request's admission
(gateway/http/admission.py) takes capacity with `admit` and hands the job back to `release`
through the job's on_close; `adapters` (the residency manager) answers everything
adapter-shaped, `router` forwards to other replicas.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING

from tqdm import tqdm

from loragw.engine.core import pin_threads
from loragw.engine.core.client import EngineClient, EngineDied
from loragw.engine.request.tokenizer import TokenText, try_load_tokenizer
from loragw.engine.snapshot import EngineInfo, EngineSnapshot
from loragw.gateway.config import ServerConfig
from loragw.gateway.errors import APIError
from loragw.gateway.fleet.router import Router
from loragw.gateway.health import EngineWatchdog
from loragw.gateway.jobs import GenerationJob
from loragw.gateway.metrics import Metrics
from loragw.gateway.residency.manager import AdapterManager
from loragw.gateway.tenants.service import Tenants

if TYPE_CHECKING:  # imported only when tracing (start_tracing)
    from loragw.gateway.tracing import Tracing

logger = logging.getLogger(__name__)
ENGINE_PROBE_TIMEOUT_S = 10.0


def start_tracing(config: ServerConfig) -> Tracing | None:
    """The replica's tracer with --otlp-traces-endpoint, else None (gateway/tracing.py and
    OpenTelemetry's tracing SDK not even imported)."""
    if config.otlp_traces_endpoint is None:
        return None
    from loragw.gateway.tracing import Tracing
    return Tracing(config.otlp_traces_endpoint, config.replica)


class Runtime:
    def __init__(self, config: ServerConfig, metrics: Metrics | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.config = config
        self.metrics = metrics or Metrics(config.metrics_max_adapters, config.model_name)
        self.on_fatal = on_fatal  # called when start-up fails (the server should exit)
        self.engine: EngineClient | None = None
        self.info: EngineInfo | None = None  # the engine's vocabulary size, context window, ...
        self.tokenizer = None  # the model's (None: prompts must be token ids)
        self.adapters: AdapterManager | None = None
        self.tenants: Tenants | None = None  # keys, limits, audit: started first
        self.router: Router | None = None
        self.tracing = start_tracing(config)  # None without --otlp-traces-endpoint
        self.token_text: TokenText | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready = False
        self.status = "starting"
        self.engine_death: str | None = None  # why the engine process exited, once it has
        self.watchdog: EngineWatchdog | None = None  # pings the engine once it runs
        self.started_at = int(time.time())
        self.inflight = 0  # sequences admitted and not yet closed
        self.jobs: set[GenerationJob] = set()
        self.metrics.gateway_capacity = config.max_capacity
        self._stack = AsyncExitStack()

    # ---- life cycle ----------------------------------------------------------------------
    @asynccontextmanager
    async def lifespan(self, _app=None) -> AsyncIterator[Runtime]:
        task = asyncio.ensure_future(self.start())
        try:
            yield self
        finally:
            task.cancel()
            await self.stop()

    async def start(self) -> None:
        config = self.config
        sources = config.adapter_sources()
        try:
            with tqdm(total=1 + len(sources), desc="loading", unit="step", disable=None) as bar:
                self.status = f"loading model {config.model}"
                bar.set_postfix_str(os.path.basename(str(config.model)))
                self.loop = asyncio.get_running_loop()
                self.tenants = Tenants(config, self.metrics)
                await self.tenants.start()
                self.engine = await self._start_engine()
                self.watchdog = EngineWatchdog(self.engine, config.health_timeout_s)
                self.watchdog.start()
                self.info = self.engine.info
                self.metrics.info = self.info
                self.tokenizer = await asyncio.to_thread(try_load_tokenizer, config.model)
                self.token_text = TokenText(self.tokenizer)
                self.adapters = AdapterManager(config, self.engine, self.metrics,
                                               tracing=self.tracing)
                await self.adapters.start()
                self.router = Router(self.adapters.registry, self.adapters.replica_id,
                                     fleet=bool(config.redis_url), tracing=self.tracing)
                await self._stack.enter_async_context(self.router.running())
                bar.update()
                for name, source in sources:
                    self.status = f"loading adapter {name}"
                    bar.set_postfix_str(name)
                    await self.adapters.load(name, source, replace=True)
                    bar.update()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self.status = f"start-up failed: {exc}"
            logger.error("start-up failed: %s", exc, exc_info=not isinstance(exc, ValueError))
            if self.on_fatal is not None:
                self.on_fatal(exc)
            return
        self.ready, self.status = True, "ready"
        logger.info("ready: model %r with %d adapter(s), context %d tokens",
                    config.model_name, len(sources), self.info.max_model_len)

    async def _start_engine(self) -> EngineClient:
        """The engine reads the model and checks the options itself: its Ready (EngineInfo)
        tells this server all it needs, the adapter spec and the request limits among it."""
        model, options = self.config.model, self.config.engine_options()
        if self.config.engine_process:
            cpus = self.config.engine_cpu_set()
            engine = await EngineClient.in_process(model, options, on_death=self._engine_died,
                                                   cpus=cpus)
            rest = os.sched_getaffinity(0) - cpus if cpus else None
            if rest:  # the HTTP server keeps off the engine's CPUs (it spawned it first)
                pin_threads(rest)
            return engine
        return await EngineClient.in_thread(model, options)

    def _engine_died(self, exc: EngineDied) -> None:
        """The engine is gone (its process, a rank): not ready any more, and the server should
        exit."""
        self.ready, self.status = False, str(exc)
        self.engine_death = str(exc)
        if self.on_fatal is not None:
            self.on_fatal(exc)

    async def stop(self) -> None:
        self.ready, self.status = False, "shutting down"
        for job in list(self.jobs):
            job.abort()  # clients still connected get finish_reason "abort", not a hang
        await self._stack.aclose()
        if self.watchdog is not None:
            await self.watchdog.stop()
        if self.adapters is not None:
            await self.adapters.close()
        if self.tenants is not None:
            await self.tenants.close()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # exports the spans still queued

    def check_ready(self) -> None:
        if not self.ready:
            raise APIError.not_ready(self.status)

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

    async def snapshot(self) -> EngineSnapshot | None:
        return await self.engine.snapshot() if self.engine is not None else None

    # ---- capacity ------------------------------------------------------------------------
    def admit(self, job: GenerationJob) -> None:
        """Count `job`'s sequences in: 400 if they could never fit, 429 if they do not fit
        now. `release` (the job's on_close) counts them out."""
        count, capacity = len(job.choices), self.config.max_capacity
        if count > capacity:
            raise APIError.bad_request(f"the request asks for {count} sequences (prompts x n) "
                                       f"but this server runs at most {capacity} at once; "
                                       "lower n or send fewer prompts", param="n")
        if self.inflight + count > capacity:
            raise APIError.overloaded(capacity)
        self.inflight += count
        self.metrics.gateway_inflight = self.inflight
        self.jobs.add(job)

    def release(self, job: GenerationJob) -> None:
        if self.tenants is not None:
            self.tenants.finish(job)
        self.inflight -= len(job.choices)
        self.metrics.gateway_inflight = self.inflight
        self.jobs.discard(job)
        assert self.inflight >= 0, "released more sequences than were admitted"

    # ---- adapters -------------------------------------------------------------------------
    async def unload_adapter(self, name: str) -> None:
        """Unload `name`, first ending its in-flight requests with finish_reason "abort"."""
        self.check_ready()
        self.adapters.tiers.record(name)  # 404 if unknown
        for job in list(self.jobs):
            if job.adapter == name:
                job.abort()
        await self.adapters.unload(name)
