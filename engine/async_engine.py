"""The engine for servers on a thread of the server's own: one background thread steps the
engine; the event loop never blocks. (engine/core/ runs it in a process of its own instead,
behind the same interface: submit_many, abort, snapshot, probe, the adapter calls, shutdown,
info, adapter_spec.)

`submit()` queues a request from any coroutine and returns an async iterator of increments.
Requests, aborts and adapter operations cross into the engine thread through one lock-guarded
inbox; outputs cross back through `loop.call_soon_threadsafe`, one call per step for all the
streams of a loop. Cancelling the iterator (a client that disconnects) aborts the sequence and
frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from dataclasses import replace

from adapters.format import LoraAdapter, load_adapter
from engine.llm_engine import EngineRequest, LLMEngine, Prompt, RequestOutput
from engine.sampling_params import SamplingParams
from engine.snapshot import EngineInfo, EngineSnapshot, engine_info, take_snapshot

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: list[tuple[Callable, Future]] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Condition()
        self._stopped = False
        self.step_errors = 0
        self.info: EngineInfo = engine_info(engine)
        self.adapter_spec = engine.lora.spec
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- called from the event loop -------------------------------------------------------
    async def call(self, fn: Callable, *args):
        """Run `fn(*args)` on the engine thread between steps; return its result."""
        future: Future = Future()
        with self._wake:
            self._inbox.append((lambda: fn(*args), future))
            self._wake.notify()
        return await asyncio.wrap_future(future)

    async def submit(self, prompt: Prompt, params: SamplingParams, adapter: str | None = None,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request (ValueError here on bad input) and return its stream of increments."""
        streams = await self.submit_many([EngineRequest(prompt, params, adapter, request_id)])
        return streams[0]

    async def submit_many(self, requests: list[EngineRequest]) -> list[AsyncIterator[RequestOutput]]:
        """Queue requests in one trip to the engine thread, all or none (LLMEngine.add_requests
        checks every one first); one stream of increments each, in order."""
        loop = asyncio.get_running_loop()
        requests = [r if r.request_id else replace(r, request_id=uuid.uuid4().hex)
                    for r in requests]
        queues = [asyncio.Queue() for _ in requests]
        for r, queue in zip(requests, queues):
            self._streams[r.request_id] = (loop, queue)
        try:
            await self.call(self.engine.add_requests, requests)
        except BaseException:
            for r in requests:
                self._streams.pop(r.request_id, None)
            raise
        return [self._stream(r.request_id, queue) for r, queue in zip(requests, queues)]

    def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        return read_stream(queue, lambda finished: self._closed(request_id, finished))

    async def _closed(self, request_id: str, finished: bool) -> None:
        self._streams.pop(request_id, None)
        if not finished:  # the caller stopped reading: free the request's blocks and slot
            await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        await self.call(self.engine.abort, request_id)

    async def snapshot(self) -> EngineSnapshot:
        """The engine's state between two steps (engine/snapshot.py)."""
        return await self.call(take_snapshot, self.engine, self.step_errors)

    async def probe(self) -> None:
        """Answers once the engine loop gets between two steps."""
        await self.call(lambda: True)

    async def add_adapter(self, name: str, path: str, adapter: LoraAdapter | None = None) -> int:
        """Register or replace `name`: `adapter` parsed already, or parsed from `path` on a
        worker thread (never the engine's)."""
        if adapter is None:
            adapter = await asyncio.to_thread(load_adapter, path, self.adapter_spec)
        return await self.call(self.engine.add_adapter, name, adapter, path)

    async def load_adapter(self, name: str) -> str:
        return await self.call(self.engine.load_adapter, name)

    async def pin_adapter(self, name: str, pinned: bool) -> None:
        await self.call(self.engine.pin_adapter, name, pinned)

    async def evict_adapter(self, name: str) -> bool:
        return await self.call(self.engine.evict_adapter, name)

    async def remove_adapter(self, name: str) -> None:
        await self.call(self.engine.remove_adapter, name)

    def shutdown(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=10)

    # ---- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self._inbox and not self.engine.has_unfinished():
                    self._wake.wait()
                if self._stopped:
                    return
                inbox, self._inbox = self._inbox, []
            for fn, future in inbox:
                if not future.set_running_or_notify_cancel():
                    continue  # the caller went away before we got to it
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed back to the caller, never kills the loop
                    future.set_exception(exc)
            # Requests ended outside a step (abort, adapter removal) tell their streams too.
            for out in self.engine.drain_aborted():
                self._deliver(out.request_id, out)
            if self.engine.has_unfinished():
                self._step()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # A failed step fails the requests it held, not the server.
            logger.exception("engine step failed")
            self.step_errors += 1
            for request_id in list(self.engine.requests):
                self.engine.abort(request_id)
                self._deliver(request_id, RuntimeError(f"engine step failed: {exc}"))
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:  # one wake-up of each loop per step, not one per token
            target = self._streams.get(out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)


async def read_stream(queue: asyncio.Queue, closed: Callable[[bool], Awaitable[None]]
                      ) -> AsyncIterator[RequestOutput]:
    """One request's outputs from its queue, up to the finished one; an exception put on the
    queue is raised. `closed(finished)` runs however the reading ends (both engine fronts,
    this thread engine and engine.core.client's process, read their streams this way)."""
    finished = False
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                finished = True
                return
    finally:
        await closed(finished)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)
