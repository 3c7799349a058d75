"""How an EngineClient (engine/core/client.py) reaches its engine loop: in a process of its own
(ProcessTransport, engine/core/spawn.py: frames over a socket) or on a thread of the server's
(ThreadTransport, engine/core/thread.py: the messages as they are). The client starts it
through its own constructors, then speaks to it through this interface only."""

from __future__ import annotations

from typing import Protocol

from loragw.engine.core.messages import ToEngine
from loragw.engine.snapshot import EngineInfo


class Transport(Protocol):
    kind: str  # what an EngineDied message calls the engine ("process", "loop")
    info: EngineInfo | None  # the engine's Ready, once started

    def encode(self, message: ToEngine) -> object:
        """The message as `send_encoded` takes it (a frame for a process); ValueError if it
        holds a value the engine cannot take. May block (a large adapter): off the loop."""

    def send(self, message: ToEngine) -> None:
        """encode, then send_encoded."""

    def send_encoded(self, encoded: object) -> None:
        """Hand an encoded message to the engine loop."""

    def shutdown(self) -> None:
        """Stop the engine loop (blocking: off the event loop)."""
