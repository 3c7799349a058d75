"""The EngineClient's transport to an engine in a process of its own (engine/core/process.py),
the default for `loragw serve`: the server keeps its event loop and the engine its step loop,
with no GIL between them. One socket pair (engine/core/channel.py: frames written and read
whole, whatever their size), read by the server's event loop, so a step's outputs for every
stream arrive as one message and wake it once. A parsed adapter crosses packed
(adapters/wire.py), never parsed again; a message that cannot be encoded fails its caller
alone, before anything is sent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from loragw.adapters.wire import pack
from loragw.engine.core.channel import ChannelClosed, ServerChannel
from loragw.engine.core.messages import (
    AddAdapter,
    FromEngine,
    Ready,
    Reply,
    Stop,
    ToEngine,
    as_error,
    decode_from_engine,
    encode,
)
from loragw.engine.snapshot import EngineInfo

logger = logging.getLogger(__name__)
STOP_TIMEOUT_S = 10.0


class ProcessTransport:
    kind = "process"  # what an EngineDied message calls the engine

    def __init__(self, model: str, options: dict[str, Any], cpus: frozenset[int] | None = None):
        """model: its directory; options: EngineOptions' fields (Config's other arguments),
        read and checked by the engine process, which alone reads the model's config.json."""
        self.model, self.options, self.cpus = model, options, cpus
        self.info: EngineInfo | None = None  # from the engine's Ready
        self.proc: subprocess.Popen | None = None
        self.channel: ServerChannel | None = None
        self._stopping = False  # shutdown() asked: the socket closing is no death

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def start(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[FromEngine], None],
                    on_closed: Callable[[BaseException | None], None]) -> None:
        """Start the process, send it the options (and the CPUs it runs on, if pinned) and wait
        for Ready; ValueError (or what the engine raised) if it fails to start."""
        ready: asyncio.Future = loop.create_future()

        def on_frame(payload: bytes) -> None:
            try:
                message = decode_from_engine(payload)
            except msgspec.DecodeError:  # a bug in the engine's side; the frames stay whole
                logger.exception("a message from the engine process does not decode; dropped")
                return
            if not ready.done():  # the first message: Ready, or why the engine did not start
                if isinstance(message, Ready):
                    self.info = message.info
                    ready.set_result(None)
                elif isinstance(message, Reply) and message.error is not None:
                    ready.set_exception(as_error(message.error))
                return
            deliver(message)

        def on_eof() -> None:
            status = self.proc.wait()
            if not ready.done():
                ready.set_exception(RuntimeError(f"the engine process exited (status {status}) "
                                                 "before it was ready; see its log above"))
            elif not self._stopping:
                on_closed(RuntimeError(f"status {status}"))

        ours, theirs = socket.socketpair()
        # -P: the working directory stays off sys.path, so a checkout's kernels/ folder never
        # shadows the Hub's `kernels` that transformers imports.
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "loragw.engine.core.process",
                                      str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        theirs.close()
        self.channel = ServerChannel(ours, loop, on_frame, on_eof)
        self.channel.send(msgspec.msgpack.encode({"model": self.model,
                                                  "cpus": sorted(self.cpus or ()),
                                                  **self.options}))
        await ready
        logger.info("engine process %d ready", self.proc.pid)

    def encode(self, message: ToEngine) -> bytes:
        """The message's frame (a parsed adapter packed first: adapters/wire.py); ValueError if
        it holds a value the engine cannot take. Blocking for a large adapter: run it off the
        event loop."""
        if isinstance(message, AddAdapter) and message.adapter is not None:
            message = msgspec.structs.replace(message, adapter=pack(message.adapter))
        try:
            return encode(message)
        except (OverflowError, TypeError) as exc:  # e.g. an integer past 64 bits: bad input
            raise ValueError(f"the request holds a value the engine cannot take: {exc}") from None

    def send(self, message: ToEngine) -> None:
        """ValueError if the message holds a value the engine cannot take (nothing is sent);
        ChannelClosed once the engine's end is gone."""
        self.send_encoded(self.encode(message))

    def send_encoded(self, frame: bytes) -> None:
        self.channel.send(frame)

    def shutdown(self) -> None:
        """Stop the process (blocking: call it off the event loop)."""
        self._stopping = True
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.channel.send(encode(Stop()))
            except ChannelClosed:
                pass
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
