"""The engine process: `python -m engine.core.process FD`, started by engine/core/client.py.

It reads the engine's Config from the socket FD, builds the LLMEngine, answers Ready, then runs
one loop on one thread: take every message that has arrived whole (waiting for one only when
there is nothing to step; engine/core/channel.py keeps a frame still arriving for later), handle
them, run one step, and send everything that step produced for every stream in one Outputs
message. A message that does not decode is answered with an error (if it names a call) and
dropped; a reply that cannot be encoded is answered with the error instead. No other thread holds the GIL while a step runs: adapter files
are parsed on a worker thread only while one is being loaded, and it wakes the loop through a
pipe. A step that fails fails its requests, never the process. When the server goes away (its
end of the socket closes), the process exits.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import sys
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import torch

from adapters.format import load_adapter
from engine.config import Config
from engine.core import pin_threads
from engine.core.channel import ChannelClosed, EngineChannel
from engine.core.messages import (
    Abort,
    Call,
    Failed,
    Outputs,
    Ready,
    Reply,
    Stop,
    Submit,
    decode_to_engine,
    encode,
    error_info,
)
from engine.llm_engine import LLMEngine
from engine.parallel.runner import RankLost
from engine.snapshot import engine_info, take_snapshot

logger = logging.getLogger("engine.core")


class _Loaded(msgspec.Struct):
    """An adapter parsed on the worker thread, back for the step loop."""

    call: int
    name: str
    path: str
    future: Future


class EngineCore:
    def __init__(self, channel: EngineChannel, config: Config):
        self.channel, self.engine = channel, LLMEngine(config)
        self.loaded: deque[_Loaded] = deque()  # appended by the worker thread
        self.wake_r, self.wake_w = os.pipe()  # the worker's "a load is done"
        self.loads = ThreadPoolExecutor(1, thread_name_prefix="adapter-load")
        self.step_errors = 0
        self.calls = {"load_adapter": self.engine.load_adapter,
                      "pin_adapter": self.engine.pin_adapter,
                      "evict_adapter": self.engine.evict_adapter,
                      "remove_adapter": self.engine.remove_adapter,
                      "snapshot": lambda: take_snapshot(self.engine, self.step_errors),
                      "probe": lambda: True}

    def send(self, message) -> None:
        try:
            frame = encode(message)
        except (OverflowError, TypeError) as exc:  # a value msgpack cannot carry: a bug here
            logger.exception("a message to the server does not encode")
            if isinstance(message, Reply):
                frame = encode(Reply(message.call, error=error_info(exc)))
            elif isinstance(message, Outputs):
                ids = [out.request_id for out in message.items]
                for request_id in ids:
                    self.engine.abort(request_id)
                self.engine.drain_aborted()
                frame = encode(Failed(ids, f"the engine's output could not be sent: {exc}"))
            else:
                raise
        self.channel.send(frame)

    def done_loading(self, loaded: _Loaded) -> None:
        """On the worker thread: hand a parsed adapter back and wake the loop."""
        self.loaded.append(loaded)
        os.write(self.wake_w, b"x")

    def arrived(self, block: bool) -> list:
        """Every message that has arrived whole (waiting for something if `block`), parsed
        adapters too; a closed socket reads as Stop."""
        ready, _, _ = select.select([self.channel, self.wake_r], [], [], None if block else 0)
        messages: list = []
        if self.wake_r in ready:
            os.read(self.wake_r, 4096)
        while self.loaded:
            messages.append(self.loaded.popleft())
        if self.channel in ready:
            try:
                frames = self.channel.receive()
            except ChannelClosed:
                return [*messages, Stop()]
            for frame in frames:
                message = self.decode(frame)
                if message is not None:
                    messages.append(message)
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
                self.send(Reply(call, error=error_info(
                    ValueError(f"the engine could not read this message: {exc}"))))
            return None

    def run(self) -> None:
        self.send(Ready(engine_info(self.engine)))
        engine = self.engine
        while True:
            for message in self.arrived(block=not engine.has_unfinished()):
                if isinstance(message, Stop):
                    return
                self.handle(message)
            outputs = engine.drain_aborted()  # ended outside a step: abort, adapter removal
            if engine.has_unfinished():
                outputs += self.step()
            if outputs:
                self.send(Outputs(outputs))

    def handle(self, message) -> None:
        if isinstance(message, Submit):
            self.reply(message.call, self.engine.add_requests, message.requests)
        elif isinstance(message, Abort):
            self.engine.abort(message.request_id)
        elif isinstance(message, Call) and message.method == "add_adapter":
            name, path = message.args
            future = self.loads.submit(load_adapter, path, self.engine.lora.spec)
            future.add_done_callback(
                lambda f: self.done_loading(_Loaded(message.call, name, path, f)))
        elif isinstance(message, _Loaded):
            self.reply(message.call, lambda: self.engine.add_adapter(
                message.name, message.future.result(), message.path))
        elif isinstance(message, Call):
            method = self.calls.get(message.method)
            if method is None:
                self.send(Reply(message.call, error=error_info(
                    RuntimeError(f"no engine call {message.method!r}"))))
            else:
                self.reply(message.call, method, *message.args)

    def reply(self, call: int, fn, *args) -> None:
        try:
            value = fn(*args)
        except Exception as exc:  # handed back to the caller, never kills the loop
            self.send(Reply(call, error=error_info(exc)))
            return
        self.send(Reply(call, value))

    def step(self) -> list:
        try:
            return self.engine.step()
        except Exception as exc:
            # A failed step fails the requests it held, not the process.
            logger.exception("engine step failed")
            self.step_errors += 1
            ids = list(self.engine.requests)
            for request_id in ids:
                self.engine.abort(request_id)
            self.engine.drain_aborted()
            fatal = isinstance(exc, RankLost)
            self.send(Failed(ids, f"engine step failed: {exc}", fatal))
            if fatal:  # no step can run again: end the process
                logger.error("%s; the engine process exits", exc)
                raise
            return []


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
        core = EngineCore(channel, Config(model, **options))
    except Exception as exc:
        logger.error("the engine failed to start: %s", exc, exc_info=not isinstance(exc, ValueError))
        channel.send(encode(Reply(0, error=error_info(exc))))
        return 1
    try:
        core.run()
    except (BrokenPipeError, ConnectionResetError):
        logger.info("the server closed the channel; the engine process exits")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
