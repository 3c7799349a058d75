"""The request driver both sides of bench_spec.py share (it runs in vLLM's venv too): keep
`concurrency` requests in flight, a new one joining as one finishes, and time each request's
tokens as the engine's step hands them out."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Drive:
    tokens: int  # generated, all requests
    seconds: float  # wall time, first add to last finish
    tpot_p50: float  # seconds per output token after the first, median over requests

    def row(self) -> dict:
        return {"tok_s": self.tokens / self.seconds, "tpot_ms": 1000 * self.tpot_p50}


def drive(n: int, concurrency: int, add: Callable[[int], str],
          step: Callable[[], list[tuple[str, int, bool]]]) -> Drive:
    """add(i) queues request i and returns its id; step() runs one engine step and returns
    (id, tokens it now has in all, finished) per request it advanced."""
    first: dict[str, float] = {}
    count: dict[str, int] = {}
    tpots, total, next_i, in_flight = [], 0, 0, 0
    start = time.perf_counter()
    while next_i < n or in_flight:
        while next_i < n and in_flight < concurrency:
            add(next_i)
            next_i += 1
            in_flight += 1
        now_outputs = step()
        now = time.perf_counter()
        for request_id, tokens, finished in now_outputs:
            first.setdefault(request_id, now)
            count[request_id] = tokens
            if finished:
                in_flight -= 1
                total += tokens
                if tokens > 1:
                    tpots.append((now - first[request_id]) / (tokens - 1))
    return Drive(total, time.perf_counter() - start, statistics.median(tpots))
