"""What the app serves with, built at start and torn down at the end: the engine, the
adapters, the tenants, the router, capacity and readiness.

`Services.lifespan` is the Litestar lifespan: it loads the engine on a worker thread (so /health
answers and /ready says 503 while weights load), joins the registry, registers the --adapter
list, marks the replica ready, and shuts everything down in `finally`. The routes never see
this object: `dependencies()` hands each the few it asks for by name (Litestar DI), and those
that need the engine are refused with 503 until it is up.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

from litestar.di import Provide
from tqdm import tqdm

from loragw.engine.api import (
    EngineClient,
    EngineDied,
    EngineInfo,
    EngineSnapshot,
    TokenText,
    pin_threads,
    try_load_tokenizer,
)
from loragw.gateway.common.config import ServerConfig
from loragw.gateway.fleet.placing import Placement
from loragw.gateway.fleet.router import Router
from loragw.gateway.http.capacity import Capacity
from loragw.gateway.http.served import ServedModel
from loragw.gateway.observe.health import EngineWatchdog, Readiness
from loragw.gateway.observe.metrics import Metrics
from loragw.gateway.openai.adapter_chats import AdapterChats
from loragw.gateway.openai.admission import Admission
from loragw.gateway.openai.chat_setup import base_setup
from loragw.gateway.openai.prompt_bounds import longest_token_bytes
from loragw.gateway.residency.demand import DemandWindow
from loragw.gateway.residency.manager import AdapterManager
from loragw.gateway.tenants.service import Tenants

if TYPE_CHECKING:  # imported only when tracing (start_tracing)
    from loragw.gateway.observe.tracing import Tracing

logger = logging.getLogger(__name__)


def start_tracing(config: ServerConfig) -> Tracing | None:
    """The replica's tracer with --otlp-traces-endpoint, else None (gateway/observe/tracing.py
    and OpenTelemetry's tracing SDK not even imported)."""
    if config.otlp_traces_endpoint is None:
        return None
    from loragw.gateway.observe.tracing import Tracing
    return Tracing(config.otlp_traces_endpoint, config.replica)


class Services:
    def __init__(self, config: ServerConfig, metrics: Metrics | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.config = config
        self.metrics = metrics or Metrics(config.metrics_max_adapters, config.model_name)
        self.on_fatal = on_fatal  # called when start-up fails (the server should then exit)
        self.readiness = Readiness()
        self.tracing = start_tracing(config)  # None without --otlp-traces-endpoint
        self.tenants = Tenants(config, self.metrics)  # keys, limits, audit: started first
        # counted as requests end, published in the heartbeat
        self.demand = DemandWindow(config.demand_window_s, config.replica_tokens_per_s)
        self.capacity = Capacity(config.max_capacity, self.metrics, self.tenants, self.demand)
        self.started_at = int(time.time())
        # built by start(), in this order; None until then
        self.engine: EngineClient | None = None
        self.info: EngineInfo | None = None
        self.served: ServedModel | None = None
        self.adapters: AdapterManager | None = None
        self.placement: Placement | None = None
        self.router: Router | None = None
        self.admission: Admission | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stack = AsyncExitStack()

    # ---- what the routes get ----------------------------------------------------------------
    def dependencies(self, config: ServerConfig) -> dict[str, Provide]:
        """Each route's dependencies by name, for an app serving with `config`; those of a
        started replica are a 503 before."""
        def fixed(value: Any) -> Callable[[], Any]:
            return lambda: value

        def started(name: str) -> Callable[[], Any]:
            def provide() -> Any:
                self.readiness.check_ready()
                return getattr(self, name)
            return provide

        values = {"config": config, "metrics": self.metrics, "readiness": self.readiness,
                  "tenants": self.tenants, "keys": self.tenants.keys, "audit": self.tenants.audit,
                  "capacity": self.capacity, "tracing": self.tracing}
        provided = {name: Provide(fixed(value), use_cache=True, sync_to_thread=False)
                    for name, value in values.items()}
        # the names are not fields of any request body: Litestar takes a body error at a field
        # named as a dependency for the dependency's (a 500)
        for name in ("engine", "adapters", "admission", "served", "placement"):
            provided[name] = Provide(started(name), sync_to_thread=False)
        provided["residencies"] = Provide(self.residencies)
        return provided

    async def residencies(self) -> tuple[EngineSnapshot | None, dict[str, str]]:
        """For /metrics, at any time: the engine's snapshot and each adapter's tiers (none
        before the engine is up)."""
        snapshot = await self.snapshot()
        adapters = self.adapters
        return snapshot, {} if adapters is None else adapters.residencies(snapshot)

    async def snapshot(self) -> EngineSnapshot | None:
        return await self.engine.snapshot() if self.engine is not None else None

    # ---- life cycle -------------------------------------------------------------------------
    @asynccontextmanager
    async def lifespan(self, _app=None) -> AsyncIterator[Services]:
        task = asyncio.ensure_future(self.start())
        try:
            yield self
        finally:
            task.cancel()
            await self.stop()

    async def start(self) -> None:
        config, readiness = self.config, self.readiness
        sources = config.adapter_sources()
        try:
            with tqdm(total=1 + len(sources), desc="loading", unit="step", disable=None) as bar:
                readiness.status = f"loading model {config.model}"
                bar.set_postfix_str(os.path.basename(str(config.model)))
                self.loop = asyncio.get_running_loop()
                await self.tenants.start()
                self.engine = readiness.engine = await self._start_engine()
                readiness.watchdog = EngineWatchdog(self.engine, config.health_timeout_s)
                readiness.watchdog.start()
                self.info = self.metrics.info = self.engine.info
                tokenizer = await asyncio.to_thread(try_load_tokenizer, config.model)
                if tokenizer is not None:  # what bounds a prompt's text, not on a request
                    await asyncio.to_thread(longest_token_bytes, tokenizer)
                self.served = ServedModel(config.model_name, str(config.model), self.info,
                                         tokenizer, TokenText(tokenizer), self.started_at)
                chats = AdapterChats(base_setup(config, tokenizer), tokenizer)
                self.adapters = AdapterManager(config, self.engine, self.metrics,
                                               tracing=self.tracing, check_chat=chats.check,
                                               demand=self.demand)
                await self.adapters.start()
                self.placement = Placement(self.adapters, self.metrics, config.redis_url)
                self.placement.start()
                self.router = Router(self.adapters.registry, self.adapters.replica_id,
                                     fleet=bool(config.redis_url), tracing=self.tracing,
                                     copies=self.placement.copies)
                await self._stack.enter_async_context(self.router.running())
                self.admission = Admission(self.engine, self.adapters, self.router, self.tenants,
                                           self.capacity, self.metrics, self.tracing, self.served,
                                           chats)
                bar.update()
                for name, source in sources:
                    readiness.status = f"loading adapter {name}"
                    bar.set_postfix_str(name)
                    await self.adapters.load(name, source, replace=True)
                    bar.update()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            readiness.status = f"start-up failed: {exc}"
            logger.error("start-up failed: %s", exc, exc_info=not isinstance(exc, ValueError))
            if self.on_fatal is not None:
                self.on_fatal(exc)
            return
        readiness.ready, readiness.status = True, "ready"
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
        self.readiness.died(str(exc))
        if self.on_fatal is not None:
            self.on_fatal(exc)

    async def stop(self) -> None:
        self.readiness.ready, self.readiness.status = False, "shutting down"
        self.capacity.abort()  # clients still connected get finish_reason "abort", not a hang
        await self._stack.aclose()
        if self.readiness.watchdog is not None:
            await self.readiness.watchdog.stop()
        if self.placement is not None:
            await self.placement.close()
        if self.adapters is not None:
            await self.adapters.close()
        await self.tenants.close()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # exports the spans still queued
