"""The engine loop, written once: take every message that has arrived (waiting for one only
when there is nothing to step), handle them, run one step, send everything that step produced
for every stream in one Outputs message. A transport only carries the messages
(engine/core/messages.py): `Inbox.take` what the server sent, `Outbox.send` what goes back; on a
thread of the server's (engine/core/thread.py) they cross as objects, to a process of the
engine's own (engine/core/process.py) as frames.

Nothing but the step holds the loop: an adapter to read from its directory (the disk tier) or
to unpack is parsed on the loader thread, whose result comes back through the inbox. A request
or call that fails is answered with its error; a step that fails fails the requests it held,
never the loop, unless a tensor-parallel rank is gone (RankLost: nothing can step again, so the
loop ends after saying why).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from loragw.adapters.format import LoraAdapter, read_adapter
from loragw.adapters.wire import unpack
from loragw.engine.core.messages import (
    Abort,
    AddAdapter,
    Call,
    Failed,
    FromEngine,
    Outputs,
    Reply,
    Stop,
    Submit,
    error_info,
)
from loragw.engine.llm_engine import LLMEngine
from loragw.engine.parallel.runner import RankLost
from loragw.engine.snapshot import take_snapshot

logger = logging.getLogger("loragw.engine.core")


@dataclass(slots=True)
class Parsed:
    """An AddAdapter whose adapter the loader thread has parsed (or failed to)."""

    message: AddAdapter
    future: Future


class Inbox(Protocol):
    def take(self, block: bool) -> list:
        """Every message that has arrived (waiting for one if `block`); Stop once the server
        is gone."""

    def put_local(self, message: Parsed) -> None:
        """From the loader thread: a parsed adapter, which wakes the loop."""


class Outbox(Protocol):
    def send(self, message: FromEngine) -> None: ...


class EngineLoop:
    def __init__(self, engine: LLMEngine, inbox: Inbox, outbox: Outbox):
        self.engine, self.inbox, self.outbox = engine, inbox, outbox
        self.step_errors = 0
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="adapter-load")
        # what Call(method, args) may run, between two steps
        self.calls = {"to_device": engine.to_device, "pin_adapter": engine.pin_adapter,
                      "evict_adapter": engine.evict_adapter,
                      "remove_adapter": engine.remove_adapter,
                      "add_draft_adapter": engine.add_draft_adapter,
                      "snapshot": lambda: take_snapshot(engine, self.step_errors),
                      "probe": lambda: True}

    def run(self) -> None:
        engine = self.engine
        try:
            while True:
                for message in self.inbox.take(block=not engine.has_unfinished()):
                    if isinstance(message, Stop):
                        return
                    self.handle(message)
                outputs = engine.drain_aborted()  # ended outside a step: abort, adapter removal
                if engine.has_unfinished():
                    outputs += self.step()
                if outputs:
                    self.outbox.send(Outputs(outputs))
                for ids, why in engine.take_failures():  # an adapter's disk copy went bad
                    self.outbox.send(Failed(ids, why))
        finally:
            self.loader.shutdown(wait=False, cancel_futures=True)

    def handle(self, message) -> None:
        if isinstance(message, Submit):
            self.reply(message.call, self.engine.add_requests, message.requests)
        elif isinstance(message, Abort):
            self.engine.abort(message.request_id)
        elif isinstance(message, AddAdapter):
            future = self.loader.submit(self._parse, message)
            future.add_done_callback(lambda f: self.inbox.put_local(Parsed(message, f)))
        elif isinstance(message, Parsed):
            m = message.message
            self.reply(m.call, lambda: self.engine.add_adapter(
                m.name, m.path, message.future.result(), m.catalog_version))
        elif isinstance(message, Call):
            method = self.calls.get(message.method)
            if method is None:
                self.outbox.send(Reply(message.call, error=error_info(
                    RuntimeError(f"no engine call {message.method!r}"))))
            else:
                self.reply(message.call, method, *message.args)

    def _parse(self, message: AddAdapter) -> LoraAdapter:
        """On the loader thread: the adapter as the server handed it on, or read from disk."""
        if message.adapter is None:
            return read_adapter(message.path, self.engine.lora.spec)
        return unpack(message.adapter) if isinstance(message.adapter, bytes) else message.adapter

    def reply(self, call: int, fn, *args) -> None:
        try:
            value = fn(*args)
        except Exception as exc:  # handed back to the caller, never ends the loop
            self.outbox.send(Reply(call, error=error_info(exc)))
            return
        self.outbox.send(Reply(call, value))

    def step(self) -> list:
        try:
            return self.engine.step()
        except Exception as exc:
            # A failed step fails the requests it held, not the loop.
            logger.exception("engine step failed")
            self.step_errors += 1
            ids = list(self.engine.requests)
            for request_id in ids:
                self.engine.abort(request_id)
            self.engine.drain_aborted()
            fatal = isinstance(exc, RankLost)
            self.outbox.send(Failed(ids, f"engine step failed: {exc}", fatal))
            if fatal:  # no step can run again: end the loop
                logger.error("%s; the engine loop ends", exc)
                raise
            return []
