"""The server's side of an engine process: `await EngineProcess.start(config)`.

The same interface as engine.async_engine.AsyncEngine (submit_many, abort, snapshot, probe, the
adapter calls, shutdown, info, adapter_spec), over one socket pair (engine/core/channel.py:
frames written and read whole, whatever their size): the event loop reads it, so a step's
outputs for every stream arrive as one message and wake the loop once; each stream then reads
its own queue. A message that cannot be encoded fails its caller alone, before anything is
sent. Cancelling a stream (a client that disconnects)
aborts its request. Streams and calls may come from other event loops too (a second front end
on the same engine): what is theirs is handed over with call_soon_threadsafe. When the process
dies, every open stream and pending call fails with a RuntimeError that says so, and `on_death`
tells the server (which then stops being ready and exits).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import msgspec

from adapters.format import LoraAdapter
from adapters.types import BaseModelSpec
from engine.async_engine import read_stream
from engine.config import Config
from engine.core.channel import ChannelClosed, ServerChannel
from engine.core.messages import (
    Abort,
    Call,
    Failed,
    Outputs,
    Ready,
    Reply,
    Stop,
    Submit,
    decode_from_engine,
    encode,
    raise_error,
)
from engine.sequence import EngineRequest, RequestOutput
from engine.snapshot import EngineInfo, EngineSnapshot

logger = logging.getLogger(__name__)
STOP_TIMEOUT_S = 10.0


class EngineDied(RuntimeError):
    """The engine process exited; nothing it held can finish."""


class EngineProcess:
    def __init__(self, config: Config, proc: subprocess.Popen, sock: socket.socket,
                 on_death: Callable[[EngineDied], None] | None):
        self.config, self.proc, self.on_death = config, proc, on_death
        self.adapter_spec: BaseModelSpec = config.adapter_spec()
        self.info: EngineInfo | None = None
        self.died: EngineDied | None = None
        self._stopping = False  # shutdown() asked: the socket closing is no death
        self._last_failure = ""  # a fatal step failure's message, for EngineDied
        self._calls: dict[int, asyncio.Future] = {}  # each on its caller's loop
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count(1)
        self._ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._loop = asyncio.get_running_loop()
        self.channel = ServerChannel(sock, self._loop, self._on_frame, self._on_closed)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    async def start(cls, config: Config, on_death: Callable[[EngineDied], None] | None = None,
                    cpus: frozenset[int] | None = None) -> EngineProcess:
        """Start the process, send it the config (and the CPUs it runs on, if pinned) and wait
        until its engine is built."""
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen([sys.executable, "-m", "engine.core.process",
                                 str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        theirs.close()
        engine = cls(config, proc, ours, on_death)
        engine.channel.send(msgspec.msgpack.encode(
            {"model": config.model, "cpus": sorted(cpus or ()), **config.engine_options()}))
        await engine._ready
        logger.info("engine process %d ready", proc.pid)
        return engine

    # ---- the socket ----------------------------------------------------------------------
    def _on_closed(self) -> None:
        if self._stopping:
            return
        why = f": {self._last_failure}" if self._last_failure else ""
        self._fail(EngineDied(f"the engine process exited (status {self.proc.wait()}){why}; "
                              "see its log above"))

    def _on_frame(self, payload: bytes) -> None:
        try:
            message = decode_from_engine(payload)
        except msgspec.DecodeError:  # a bug in the engine's side; the frames stay whole
            logger.exception("a message from the engine process does not decode; dropped")
            return
        if isinstance(message, Outputs):
            for out in message.items:
                self._put(out.request_id, out)
        elif isinstance(message, Reply):
            future = self._calls.pop(message.call, None)
            if message.call == 0 and not self._ready.done():  # the engine failed to start
                self._ready.set_exception(_error(message))
            elif future is not None:
                outcome = _error(message) if message.error is not None else message.value
                _on_its_loop(self._loop, future, _settle, future, outcome)
        elif isinstance(message, Failed):
            if message.fatal:  # why the process is about to exit
                self._last_failure = message.message
            for request_id in message.request_ids:
                self._put(request_id, RuntimeError(message.message))
        elif isinstance(message, Ready):
            self.info = message.info
            self._ready.set_result(None)

    def _fail(self, exc: EngineDied) -> None:
        if self.died is not None:
            return
        self.died = exc
        self.channel.close()
        logger.error("%s", exc)
        if not self._ready.done():
            self._ready.set_exception(exc)
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

    def _send(self, message) -> None:
        if self.died is not None:
            raise self.died
        try:
            frame = encode(message)
        except (OverflowError, TypeError) as exc:  # e.g. an integer past 64 bits: bad input
            raise ValueError(f"the request holds a value the engine cannot take: {exc}") from None
        try:
            self.channel.send(frame)
        except ChannelClosed:
            raise self.died or EngineDied("the engine process has closed its channel") from None

    async def _call(self, method: str, *args):
        call = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call] = future
        self._send(Call(call, method, list(args)))
        return await future

    # ---- AsyncEngine's interface -----------------------------------------------------------
    async def submit_many(self, requests: list[EngineRequest]) -> list[AsyncIterator[RequestOutput]]:
        """Queue requests, all or none (the engine checks every one first); one stream each."""
        requests = [r if r.request_id else replace(r, request_id=uuid.uuid4().hex)
                    for r in requests]
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in requests]
        for r, queue in zip(requests, queues):
            self._streams[r.request_id] = (loop, queue)
        call = next(self._ids)
        future = loop.create_future()
        self._calls[call] = future
        try:
            self._send(Submit(call, requests))
            await future
        except BaseException:
            for r in requests:
                self._streams.pop(r.request_id, None)
            raise
        return [self._stream(r.request_id, queue) for r, queue in zip(requests, queues)]

    def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        return read_stream(queue, lambda finished: self._closed(request_id, finished))

    async def _closed(self, request_id: str, finished: bool) -> None:
        self._streams.pop(request_id, None)
        if not finished and self.died is None:  # abandoned while the process still runs
            await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        if self.died is None:
            self._send(Abort(request_id))

    async def snapshot(self) -> EngineSnapshot:
        return msgspec.convert(await self._call("snapshot"), EngineSnapshot)

    async def probe(self) -> None:
        await self._call("probe")

    async def add_adapter(self, name: str, path: str, adapter: LoraAdapter | None = None) -> int:
        """Register or replace `name` from its directory (parsed in the engine process: the
        tensors of `adapter`, parsed here already, cannot cross)."""
        return await self._call("add_adapter", name, path)

    async def load_adapter(self, name: str) -> str:
        return await self._call("load_adapter", name)

    async def pin_adapter(self, name: str, pinned: bool) -> None:
        await self._call("pin_adapter", name, pinned)

    async def evict_adapter(self, name: str) -> bool:
        return await self._call("evict_adapter", name)

    async def remove_adapter(self, name: str) -> None:
        await self._call("remove_adapter", name)

    def shutdown(self) -> None:
        """Stop the process (blocking: call it off the event loop)."""
        self._stopping = True
        if self.died is None and self.proc.poll() is None:
            try:
                self.channel.send(encode(Stop()))
            except ChannelClosed:
                pass
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


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


def _error(reply: Reply) -> Exception:
    try:
        raise_error(reply.error)
    except Exception as exc:
        return exc
    raise AssertionError("raise_error returned")
