"""The serving state behind the HTTP handlers: the engine, the adapters, capacity, readiness.

`Runtime.lifespan` is the Litestar lifespan: it loads the engine on a worker thread (so /health
answers and /ready says 503 while weights load), registers the --adapter list, marks the
runtime ready, and shuts the engine down in `finally`. Handlers call `start_job` to turn
validated prompts into a GenerationJob, and `resolver` for everything adapter-shaped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace

from tqdm import tqdm

from engine.async_engine import AsyncEngine
from engine.config import Config
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from gateway.adapter_manager import AdapterManager
from gateway.config import ServerConfig
from gateway.errors import APIError
from gateway.formats import TokenText
from gateway.metrics import EngineSnapshot, Metrics
from gateway.streaming import Choice, GenerationJob

logger = logging.getLogger(__name__)
ENGINE_PROBE_TIMEOUT_S = 10.0


class Runtime:
    def __init__(self, config: ServerConfig, metrics: Metrics | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.config = config
        self.metrics = metrics or Metrics()
        self.on_fatal = on_fatal  # called when start-up fails (the server should exit)
        self.llm: LLMEngine | None = None
        self.engine: AsyncEngine | None = None
        self.resolver: AdapterManager | None = None
        self.token_text: TokenText | None = None
        self.ready = False
        self.status = "starting"
        self.started_at = int(time.time())
        self.inflight = 0  # sequences admitted and not yet closed
        self.jobs: set[GenerationJob] = set()
        self.metrics.gateway_capacity = config.max_capacity

    # ---- life cycle ----------------------------------------------------------------------
    @asynccontextmanager
    async def lifespan(self, _app=None) -> AsyncIterator[Runtime]:
        task = asyncio.ensure_future(self.start())
        try:
            yield self
        finally:
            task.cancel()
            await self.stop()

    def engine_config(self) -> Config:
        c = self.config
        assert c.model is not None, "resolve --demo into a model path before starting"
        return Config(model=c.model, device=c.device, dtype=c.dtype, max_num_seqs=c.max_num_seqs,
                      max_num_batched_tokens=c.max_num_batched_tokens,
                      max_model_len=c.max_model_len,
                      enable_prefix_caching=c.enable_prefix_caching, max_loras=c.max_loras,
                      max_lora_rank=c.max_lora_rank, max_cpu_loras=c.max_cpu_loras,
                      lora_starvation_steps=c.lora_starvation_steps or None,
                      max_full_module_slots=c.max_full_module_slots)

    async def start(self) -> None:
        sources = self.config.adapter_sources()
        try:
            with tqdm(total=1 + len(sources), desc="loading", unit="step", disable=None) as bar:
                self.status = f"loading model {self.config.model}"
                bar.set_postfix_str(os.path.basename(str(self.config.model)))
                self.llm = await asyncio.to_thread(LLMEngine, self.engine_config())
                self.engine = AsyncEngine(self.llm)
                self.token_text = TokenText(self.llm.tokenizer)
                self.resolver = AdapterManager(self.config.model_name, self.engine, self.llm,
                                               self.metrics, self.config)
                await self.resolver.start()
                bar.update()
                for name, source in sources:
                    self.status = f"loading adapter {name}"
                    bar.set_postfix_str(name)
                    await self.resolver.load(name, source, replace=True)
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
                    self.config.model_name, len(sources), self.llm.config.max_model_len)

    async def stop(self) -> None:
        self.ready, self.status = False, "shutting down"
        for job in list(self.jobs):
            job.abort()  # clients still connected get finish_reason "abort", not a hang
        if isinstance(self.resolver, AdapterManager):
            await self.resolver.close()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)

    def check_ready(self) -> None:
        if not self.ready:
            raise APIError.not_ready(self.status)

    async def probe(self, timeout: float = ENGINE_PROBE_TIMEOUT_S) -> None:
        """/ready: loaded, and the engine loop answers between two steps within `timeout`."""
        self.check_ready()
        # shield: a timed-out probe must not cancel the call the engine thread will still run
        answered = asyncio.shield(self.engine.call(lambda: True))
        try:
            await asyncio.wait_for(answered, timeout)
        except asyncio.TimeoutError:
            raise APIError.not_ready(f"the engine loop has not answered in {timeout:.0f} s "
                                     "(wedged, or one step is that slow)") from None

    # ---- engine state --------------------------------------------------------------------
    async def snapshot(self) -> EngineSnapshot | None:
        if self.engine is None or self.llm is None:
            return None
        snapshot = await self.engine.call(take_snapshot, self.llm)
        return replace(snapshot, step_errors=self.engine.step_errors)

    @property
    def max_model_len(self) -> int:
        assert self.llm is not None
        return self.llm.config.max_model_len

    # ---- generation ----------------------------------------------------------------------
    async def start_job(self, prompts: list[list[int]], params: list[SamplingParams],
                        prompt_of: list[int], adapter: str | None, arrival: float,
                        id_prefix: str) -> GenerationJob:
        """Admit, validate and submit one engine request per choice (choice i runs prompt
        `prompts[prompt_of[i]]` with `params[i]`); 429 when the gateway is full."""
        self.check_ready()
        llm, engine, count = self.llm, self.engine, len(params)
        self.check_capacity(count)
        for i, p in enumerate(params):
            try:
                llm.validate(prompts[prompt_of[i]], p)  # reads only constants: thread-safe
            except ValueError as exc:  # InvalidParam names the parameter
                raise APIError.bad_request(str(exc), param=getattr(exc, "param", None)) from None
        choices = [Choice(i, f"{id_prefix}-{i}", prompt_of[i], len(prompts[prompt_of[i]]))
                   for i in range(count)]
        job = GenerationJob(id_prefix, engine, choices, adapter, self.metrics, arrival,
                            self._release)
        self.inflight += count
        self.metrics.gateway_inflight = self.inflight
        self.jobs.add(job)
        label = adapter or "base"
        self.metrics.prompt_tokens.labels(label).inc(sum(len(p) for p in prompts))
        try:
            for choice, p in zip(choices, params, strict=True):
                choice.stream = await engine.submit(prompts[choice.prompt_index], p, adapter,
                                                    choice.request_id)
        except BaseException as exc:
            job.close()
            if isinstance(exc, ValueError):  # AdapterError included: an adapter went away
                raise APIError(getattr(exc, "status", 400), str(exc)) from None
            raise
        return job

    # ---- adapters -------------------------------------------------------------------------
    async def unload_adapter(self, name: str) -> None:
        """Unload `name`, first ending its in-flight requests with finish_reason "abort"."""
        self.check_ready()
        self.resolver.check_loaded(name)
        for job in list(self.jobs):
            if job.adapter == name:
                job.abort()
        await self.resolver.unload(name)

    def check_capacity(self, count: int) -> None:
        """400 if `count` sequences could never fit; 429 if they do not fit now."""
        capacity = self.config.max_capacity
        if count > capacity:
            raise APIError.bad_request(f"the request asks for {count} sequences (prompts x n) "
                                       f"but this server runs at most {capacity} at once; "
                                       "lower n or send fewer prompts", param="n")
        if self.inflight + count > capacity:
            raise APIError.overloaded(capacity)

    def _release(self, job: GenerationJob) -> None:
        self.inflight -= len(job.choices)
        self.metrics.gateway_inflight = self.inflight
        self.jobs.discard(job)
        assert self.inflight >= 0, "released more sequences than were admitted"


def take_snapshot(llm: LLMEngine) -> EngineSnapshot:
    """Runs on the engine thread (AsyncEngine.call), between steps."""
    lora, stats = llm.lora, llm.lora.stats
    return EngineSnapshot(
        num_running=llm.num_running, num_waiting=llm.num_waiting,
        kv_blocks_total=llm.block_manager.num_blocks, kv_blocks_free=llm.num_free_kv_blocks,
        slots_total=len(lora.slots), slots_in_use=lora.slots_in_use,
        residency={name: lora.residency(name) for name in lora.adapters},
        preemptions=llm.scheduler.num_preemptions,
        loads={"device": stats.device_loads, "host": stats.host_loads},
        evictions={"device": stats.device_evictions, "host": stats.host_evictions},
        hits={"device": stats.device_hits},
        prefix_cache_queries=llm.block_manager.cache.stats.queries,
        prefix_cache_hits=llm.block_manager.cache.stats.hits,
        lora_device_bytes=dict(lora.device_bytes))
