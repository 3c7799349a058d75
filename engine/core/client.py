"""What a server holds of its engine: an `EngineClient`, whatever carries its messages.

    client = await EngineClient.in_process(config, on_death, cpus)   # its own process
    client = EngineClient.on_thread(llm_engine)                       # a thread of ours

Both run engine/core/loop.py's EngineLoop and carry engine/core/messages.py's messages (a
transport: engine/core/spawn.py, engine/core/thread.py); the stream table, the pending calls
and the failure path are this module's, once. Each request's stream reads its own queue;
cancelling a stream (a client that disconnects) aborts its request. Streams and calls may come
from other event loops too (a second front end on the same engine): what is theirs is handed
over with call_soon_threadsafe. When the engine loop ends on its own (its process died, a
tensor-parallel rank is gone) every open stream and pending call fails with EngineDied, which
says why, and `on_death` tells the server (which then stops being ready and exits).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import msgspec

from loragw.adapters.format import LoraAdapter
from loragw.adapters.types import BaseModelSpec
from loragw.engine.config import Config
from loragw.engine.core.channel import ChannelClosed
from loragw.engine.core.messages import (
    Abort,
    AddAdapter,
    Call,
    Failed,
    FromEngine,
    Outputs,
    Reply,
    Submit,
    ToEngine,
    as_error,
)
from loragw.engine.core.spawn import ProcessTransport
from loragw.engine.core.thread import ThreadTransport
from loragw.engine.core.transport import Transport
from loragw.engine.llm_engine import LLMEngine
from loragw.engine.request.params import SamplingParams
from loragw.engine.request.sequence import EngineRequest, Prompt, RequestOutput
from loragw.engine.snapshot import EngineInfo, EngineSnapshot

logger = logging.getLogger(__name__)


class EngineDied(RuntimeError):
    """The engine loop ended (its process exited, a rank is gone); nothing it held can finish."""


class EngineClient:
    def __init__(self, transport: Transport,
                 on_death: Callable[[EngineDied], None] | None = None):
        self.transport, self.on_death = transport, on_death
        self.died: EngineDied | None = None
        self._last_failure = ""  # a fatal step failure's message, for EngineDied
        self._calls: dict[int, asyncio.Future] = {}  # each on its caller's loop
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count(1)
        self._loop = asyncio.get_running_loop()

    @classmethod
    async def in_process(cls, model: str, options: dict[str, Any],
                         on_death: Callable[[EngineDied], None] | None = None,
                         cpus: frozenset[int] | None = None) -> EngineClient:
        """The engine of `model` (its directory) and `options` (EngineOptions' fields) in a
        process of its own, started and ready."""
        transport = ProcessTransport(model, options, cpus)
        client = cls(transport, on_death)
        await transport.start(client._loop, client._on_message, client._on_closed)
        return client

    @classmethod
    async def in_thread(cls, model: str, options: dict[str, Any]) -> EngineClient:
        """The engine of `model` and `options` built here (off the event loop) and stepped by
        a thread of this process."""
        engine = await asyncio.to_thread(LLMEngine, Config(model, **options))
        return cls.on_thread(engine, owned=True)

    @classmethod
    def on_thread(cls, engine: LLMEngine, owned: bool = False) -> EngineClient:
        """`engine` stepped by a thread of this process (call it on the server's event loop);
        `owned`: shutdown() closes it too."""
        transport = ThreadTransport(engine, owned)
        client = cls(transport)
        transport.start(client._loop, client._on_message, client._on_closed)
        return client

    @property
    def info(self) -> EngineInfo:
        return self.transport.info

    @property
    def adapter_spec(self) -> BaseModelSpec:
        return self.transport.info.adapter_spec

    # ---- messages from the engine (on the owner loop) --------------------------------------
    def _on_message(self, message: FromEngine) -> None:
        if isinstance(message, Outputs):
            for out in message.items:
                self._put(out.request_id, out)
        elif isinstance(message, Reply):
            future = self._calls.pop(message.call, None)
            if future is not None:
                outcome = as_error(message.error) if message.error is not None else message.value
                _on_its_loop(self._loop, future, _settle, future, outcome)
        elif isinstance(message, Failed):
            if message.fatal:  # why the engine loop is about to end
                self._last_failure = message.message
            for request_id in message.request_ids:
                self._put(request_id, RuntimeError(message.message))

    def _on_closed(self, failure: BaseException | None) -> None:
        """The engine loop ended without being asked to (`failure`: how, if known)."""
        if self.died is not None:
            return
        why = f": {self._last_failure}" if self._last_failure else ""
        how = f" ({failure})" if failure is not None else ""
        self.died = exc = EngineDied(f"the engine {self.transport.kind} exited{how}{why}; see "
                                     "its log above")
        logger.error("%s", exc)
        for future in self._calls.values():
            _on_its_loop(self._loop, future, _settle, future, exc)
        self._calls.clear()
        for request_id in list(self._streams):
            self._put(request_id, exc)
        if self.on_death is not None:
            self.on_death(exc)

    def _put(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, queue = target
            if loop is self._loop:
                queue.put_nowait(item)
            else:
                loop.call_soon_threadsafe(queue.put_nowait, item)

    # ---- messages to the engine ------------------------------------------------------------
    def _send(self, message: ToEngine, encoded=None) -> None:
        """Send `message` (or its frame, `encoded` already by the transport)."""
        if self.died is not None:
            raise self.died
        try:
            if encoded is None:
                self.transport.send(message)
            else:
                self.transport.send_encoded(encoded)
        except ChannelClosed:
            raise self.died or EngineDied("the engine process has closed its channel") from None

    async def _request(self, make: Callable[[int], ToEngine], off_loop: bool = False):
        """Send the message `make(call id)` and wait for its Reply's value; `off_loop`: encode
        it on a worker thread first (a packed adapter can be large)."""
        call = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call] = future
        try:
            message = make(call)
            encoded = await asyncio.to_thread(self.transport.encode, message) if off_loop else None
            self._send(message, encoded)
        except BaseException:
            self._calls.pop(call, None)
            raise
        return await future

    async def _call(self, method: str, *args):
        return await self._request(lambda call: Call(call, method, list(args)))

    # ---- the interface ---------------------------------------------------------------------
    async def submit_many(self, requests: list[EngineRequest]) -> list[AsyncIterator[RequestOutput]]:
        """Queue requests, all or none (the engine checks every one first); one stream of
        increments each, in order. ValueError (InvalidParam, AdapterError) on bad input."""
        requests = [r if r.request_id else replace(r, request_id=uuid.uuid4().hex)
                    for r in requests]
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in requests]
        for r, queue in zip(requests, queues):
            self._streams[r.request_id] = (loop, queue)
        try:
            await self._request(lambda call: Submit(call, requests))
        except BaseException:
            for r in requests:
                self._streams.pop(r.request_id, None)
            raise
        return [read_stream(queue, lambda finished, rid=r.request_id: self._closed(rid, finished))
                for r, queue in zip(requests, queues)]

    async def submit(self, prompt: Prompt, params: SamplingParams, adapter: str | None = None,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        (stream,) = await self.submit_many([EngineRequest(prompt, params, adapter, request_id)])
        return stream

    async def _closed(self, request_id: str, finished: bool) -> None:
        self._streams.pop(request_id, None)
        if not finished and self.died is None:  # abandoned: free its blocks and slot
            await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        if self.died is None:
            self._send(Abort(request_id))

    async def snapshot(self) -> EngineSnapshot:
        return msgspec.convert(await self._call("snapshot"), EngineSnapshot)

    async def probe(self) -> None:
        """Answers once the engine loop gets between two steps."""
        await self._call("probe")

    async def add_adapter(self, name: str, path: str | None,
                          adapter: LoraAdapter | None = None,
                          catalog_version: int | None = None) -> int:
        """Register or replace `name`: `adapter`, parsed and validated already where its bytes
        were read, or else read and parsed from `path` (its disk copy, also where the engine
        re-reads it after a host eviction) on the engine's loader thread. Its engine version;
        `catalog_version` is the fleet's, the number the engine's logs give it."""
        return await self._request(
            lambda call: AddAdapter(call, name, path, adapter, catalog_version),
            off_loop=adapter is not None)

    async def to_device(self, name: str) -> str:
        """Into a device slot now if one can be had; "device" or "host"."""
        return await self._call("to_device", name)

    async def pin_adapter(self, name: str, pinned: bool) -> None:
        await self._call("pin_adapter", name, pinned)

    async def evict_adapter(self, name: str) -> bool:
        return await self._call("evict_adapter", name)

    async def remove_adapter(self, name: str) -> None:
        await self._call("remove_adapter", name)

    async def add_draft_adapter(self, name: str, path: str) -> None:
        """The draft-model LoRA (read from `path`) that drafts for adapter `name`'s rows;
        AdapterError when it does not fit the draft, ValueError without a draft model."""
        await self._call("add_draft_adapter", name, path)

    def shutdown(self) -> None:
        """Stop the engine loop (blocking: call it off the event loop)."""
        self.transport.shutdown()


async def read_stream(queue: asyncio.Queue, closed: Callable[[bool], Awaitable[None]]
                      ) -> AsyncIterator[RequestOutput]:
    """One request's outputs from its queue, up to the finished one; an exception put on the
    queue is raised. `closed(finished)` runs however the reading ends."""
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


def _settle(future: asyncio.Future, outcome) -> None:
    if not future.done():
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


def _on_its_loop(owner: asyncio.AbstractEventLoop, future: asyncio.Future, fn, *args) -> None:
    loop = future.get_loop()
    if loop is owner:
        fn(*args)
    else:
        loop.call_soon_threadsafe(fn, *args)
