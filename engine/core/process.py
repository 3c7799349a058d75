"""The engine process: `python -m engine.core.process FD`, started by engine/core/client.py.

It reads the engine's Config from the socket FD, builds the LLMEngine, answers Ready, then runs
one loop on one thread: take every message that has arrived (waiting for one only when there is
nothing to step), handle them, run one step, and send everything that step produced for every
stream in one Outputs message. No other thread holds the GIL while a step runs: adapter files
are parsed on a worker thread only while one is being loaded, and it wakes the loop through a
pipe. A step that fails fails its requests, never the process. When the server goes away (its
end of the socket closes), the process exits.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection, wait

import msgspec
import torch

from adapters.format import load_adapter
from engine.config import Config
from engine.core import pin_threads
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
    def __init__(self, conn: Connection, config: Config):
        self.conn, self.engine = conn, LLMEngine(config)
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
        self.conn.send_bytes(encode(message))

    def done_loading(self, loaded: _Loaded) -> None:
        """On the worker thread: hand a parsed adapter back and wake the loop."""
        self.loaded.append(loaded)
        os.write(self.wake_w, b"x")

    def arrived(self, block: bool) -> list:
        """Every message that has arrived (waiting for one if `block`), parsed adapters too; a
        closed socket reads as Stop."""
        ready = wait([self.conn, self.wake_r], timeout=None if block else 0)
        messages = []
        if self.wake_r in ready:
            os.read(self.wake_r, 4096)
        while self.loaded:
            messages.append(self.loaded.popleft())
        if self.conn in ready:
            try:
                while True:
                    messages.append(decode_to_engine(self.conn.recv_bytes()))
                    if not self.conn.poll(0):
                        break
            except (EOFError, OSError):
                messages.append(Stop())
        return messages

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
    conn = Connection(int(argv[0]))
    try:
        options = msgspec.msgpack.decode(conn.recv_bytes())
    except (EOFError, OSError):
        return 0  # the server went away before it sent a config
    model, cpus = options.pop("model"), options.pop("cpus")
    if cpus:  # before torch starts its thread pool: every thread it makes inherits the mask
        pin_threads(set(cpus))
        torch.set_num_threads(len(cpus))
    try:
        core = EngineCore(conn, Config(model, **options))
    except Exception as exc:
        logger.error("the engine failed to start: %s", exc, exc_info=not isinstance(exc, ValueError))
        conn.send_bytes(encode(Reply(0, error=error_info(exc))))
        return 1
    core.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
