"""The engine in a process of its own: `python -P -m loragw.engine.core.process FD`, started by
engine/core/spawn.py. It reads the engine's options from the socket FD, builds the LLMEngine,
answers Ready, then runs engine/core/loop.py's EngineLoop over the socket: frames in (taken
whole, a frame still arriving kept for later: engine/core/channel.py), frames out. No other
thread holds the GIL while a step runs: the loader thread parses only while an adapter is being
loaded, and wakes the loop through a pipe. When the server goes away (its end of the socket
closes), the process exits.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import sys
from collections import deque

import msgspec
import torch

from loragw.engine.config import Config
from loragw.engine.core import pin_threads
from loragw.engine.core.channel import ChannelClosed, EngineChannel
from loragw.engine.core.loop import EngineLoop, Parsed
from loragw.engine.core.messages import (
    Failed,
    FromEngine,
    Outputs,
    Ready,
    Reply,
    Stop,
    decode_to_engine,
    encode,
    error_info,
)
from loragw.engine.llm_engine import LLMEngine
from loragw.engine.snapshot import engine_info

logger = logging.getLogger("loragw.engine.core")


class ChannelInbox:
    def __init__(self, channel: EngineChannel):
        self.channel = channel
        self.parsed: deque[Parsed] = deque()  # appended by the loader thread
        self.wake_r, self.wake_w = os.pipe()  # the loader's "a parse is done"

    def put_local(self, message: Parsed) -> None:
        self.parsed.append(message)
        os.write(self.wake_w, b"x")

    def take(self, block: bool) -> list:
        ready, _, _ = select.select([self.channel, self.wake_r], [], [], None if block else 0)
        messages: list = []
        if self.wake_r in ready:
            os.read(self.wake_r, 4096)
        while self.parsed:
            messages.append(self.parsed.popleft())
        if self.channel in ready:
            try:
                frames = self.channel.receive()
            except ChannelClosed:
                return [*messages, Stop()]
            messages += [m for m in map(self.decode, frames) if m is not None]
        return messages

    def decode(self, frame: bytes):
        """A whole frame's message, or None after answering its call (if it names one) with
        the decoding error: a bad message fails its caller, not the engine."""
        try:
            return decode_to_engine(frame)
        except msgspec.DecodeError as exc:
            logger.error("a message from the server does not decode: %s", exc)
            try:
                call = msgspec.msgpack.decode(frame).get("call")
            except Exception:
                call = None
            if isinstance(call, int):
                self.channel.send(encode(Reply(call, error=error_info(
                    ValueError(f"the engine could not read this message: {exc}")))))
            return None


class ChannelOutbox:
    def __init__(self, channel: EngineChannel, engine: LLMEngine):
        self.channel, self.engine = channel, engine

    def send(self, message: FromEngine) -> None:
        try:
            frame = encode(message)
        except (OverflowError, TypeError) as exc:  # a value msgpack cannot carry: a bug here
            logger.exception("a message to the server does not encode")
            frame = encode(self._instead(message, exc))
        self.channel.send(frame)

    def _instead(self, message: FromEngine, exc: Exception) -> FromEngine:
        """What to send for a message that would not encode: its caller's error."""
        if isinstance(message, Reply):
            return Reply(message.call, error=error_info(exc))
        if isinstance(message, Outputs):  # their requests cannot be told more: end them
            ids = [out.request_id for out in message.items]
            for request_id in ids:
                self.engine.abort(request_id)
            self.engine.drain_aborted()
            return Failed(ids, f"the engine's output could not be sent: {exc}")
        raise exc


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    channel = EngineChannel(socket.socket(fileno=int(argv[0])))
    try:
        options = msgspec.msgpack.decode(channel.receive_one())
    except (EOFError, OSError):
        return 0  # the server went away before it sent a config
    model, cpus = options.pop("model"), options.pop("cpus")
    if cpus:  # before torch starts its thread pool: every thread it makes inherits the mask
        pin_threads(set(cpus))
        torch.set_num_threads(len(cpus))
    try:
        engine = LLMEngine(Config(model, **options))
    except Exception as exc:
        logger.error("the engine failed to start: %s", exc, exc_info=not isinstance(exc, ValueError))
        channel.send(encode(Reply(0, error=error_info(exc))))
        return 1
    outbox = ChannelOutbox(channel, engine)
    try:
        outbox.send(Ready(engine_info(engine)))
        EngineLoop(engine, ChannelInbox(channel), outbox).run()
    except (BrokenPipeError, ConnectionResetError):
        logger.info("the server closed the channel; the engine process exits")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
