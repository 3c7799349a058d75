"""What a request's access-log line and counters record when its status line cannot say it: a
stream whose 200 went out before the engine (or anything else) failed it mid-way.

RequestContextMiddleware (gateway/app.py) opens one `Outcome` per request with
`tracking()`; code that runs on the request's behalf but holds no Request (an SSE stream's
iterator, run by Litestar in a task of the request's own) marks it with `stream_failed()`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(slots=True)
class Outcome:
    failed_after_headers: bool = False  # set by stream_failed(); read once the response ends


_current: ContextVar[Outcome | None] = ContextVar("request_outcome", default=None)


@contextmanager
def tracking() -> Iterator[Outcome]:
    """The outcome of the request served inside the block (tasks it starts see it too)."""
    outcome = Outcome()
    token = _current.set(outcome)
    try:
        yield outcome
    finally:
        _current.reset(token)


def stream_failed() -> None:
    """The current request's stream ended in an error after its headers went out: it counts
    and logs as a server error (500), not as the 200 its status line said."""
    outcome = _current.get()
    if outcome is not None:
        outcome.failed_after_headers = True
