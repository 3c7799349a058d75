"""The engine loop on a thread of the server's (`loragw serve --no-engine-process`, tests,
benchmarks): engine/core/loop.py's EngineLoop, with messages crossing as objects. Into the
loop through one lock-guarded inbox; back to the server's event loop through
`loop.call_soon_threadsafe`, one call per message, so one step's outputs for every stream wake
the event loop once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from loragw.engine.core.loop import EngineLoop, Parsed
from loragw.engine.core.messages import FromEngine, Stop, ToEngine
from loragw.engine.llm_engine import LLMEngine
from loragw.engine.snapshot import EngineInfo, engine_info


class ThreadInbox:
    def __init__(self) -> None:
        self._messages: list = []
        self._wake = threading.Condition()

    def put(self, message: ToEngine | Parsed) -> None:
        with self._wake:
            self._messages.append(message)
            self._wake.notify()

    put_local = put

    def take(self, block: bool) -> list:
        with self._wake:
            while block and not self._messages:
                self._wake.wait()
            messages, self._messages = self._messages, []
        return messages


class LoopOutbox:
    """Hands each message to `deliver` on the server's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[FromEngine], None]):
        self.loop, self.deliver = loop, deliver

    def send(self, message: FromEngine) -> None:
        self.loop.call_soon_threadsafe(self.deliver, message)


class ThreadTransport:
    """The EngineClient's transport to an engine loop on a thread (engine/core/client.py)."""

    kind = "loop"  # what an EngineDied message calls the engine

    def __init__(self, engine: LLMEngine, owned: bool = False):
        self.engine = engine  # the LLMEngine the thread steps (tests reach into it)
        self.owned = owned  # shutdown() closes the engine too
        self.info: EngineInfo = engine_info(engine)
        self.inbox = ThreadInbox()
        self._thread: threading.Thread | None = None
        self._stopping = False  # shutdown() asked: the loop ending is no death

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[FromEngine], None],
              on_closed: Callable[[BaseException | None], None]) -> None:
        core = EngineLoop(self.engine, self.inbox, LoopOutbox(loop, deliver))

        def run() -> None:
            failure: BaseException | None = None
            try:
                core.run()
            except BaseException as exc:  # the loop ended on its own (a lost rank): say why
                failure = exc
            if self._stopping:
                return
            try:
                loop.call_soon_threadsafe(on_closed, failure)
            except RuntimeError:  # the server's event loop is closed already: nobody to tell
                pass

        self._thread = threading.Thread(target=run, name="engine-loop", daemon=True)
        self._thread.start()

    def encode(self, message: ToEngine) -> ToEngine:
        return message  # messages cross a thread as they are

    def send(self, message: ToEngine) -> None:
        self.inbox.put(message)

    send_encoded = send

    def shutdown(self) -> None:
        self._stopping = True
        self.inbox.put(Stop())
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.owned:
            self.engine.close()
