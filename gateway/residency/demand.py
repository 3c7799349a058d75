"""Per-adapter demand over a sliding window: what the placement plan is computed from.

Each replica counts the requests and tokens (prompt + generated) it serves per adapter in
`BUCKET_S` buckets over `WINDOW_S` (gateway/http/capacity.py records a request as it ends),
and publishes its `PUBLISHED` busiest adapters' rates in its heartbeat (ReplicaState.demand);
the planner sums the replicas' rates (`fleet_demand`), so the fleet's demand lives in Redis
with the heartbeats and goes when a replica does.

    window = DemandWindow()
    window.record("bot", tokens=412)            # a request served here, once it ends
    window.rates()  -> {"bot": Demand(tokens_per_s=6.9, requests_per_s=0.017)}
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from loragw.adapters.registry import ReplicaState

BUCKET_S = 5.0
WINDOW_S = 60.0
PUBLISHED = 256  # adapters a heartbeat carries rates for: the busiest (a state stays small)
RECENT_BUCKETS = 2  # a rise shows within this many buckets; a fall fades over the window


@dataclass(frozen=True, slots=True)
class Demand:
    tokens_per_s: float
    requests_per_s: float = 0.0


class FullLoadRate:
    """The tokens/s this replica serves at full load, measured: its served rate between two
    heartbeats in which requests waited (the engine took all it could), smoothed. 0 until it
    has been saturated once; a configured rate (--replica-tokens-per-s) replaces it."""

    SMOOTHING = 0.3  # weight of the newest saturated interval

    def __init__(self, configured: float = 0.0):
        self.configured, self.measured = configured, 0.0
        self._last: tuple[float, int] | None = None  # (time, total tokens) at the last look

    def observe(self, total_tokens: int, saturated: bool, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        last, self._last = self._last, (now, total_tokens)
        if saturated and last is not None and now > last[0] and total_tokens > last[1]:
            rate = (total_tokens - last[1]) / (now - last[0])
            self.measured = rate if not self.measured else (
                self.SMOOTHING * rate + (1 - self.SMOOTHING) * self.measured)
        return self.configured or self.measured


class DemandWindow:
    def __init__(self, window_s: float = WINDOW_S, tokens_per_s: float = 0.0,
                 bucket_s: float | None = None):
        self.window_s = window_s
        self.bucket_s = bucket_s or min(BUCKET_S, window_s / 12)
        self.total_tokens = 0  # ever recorded: what `full_load` differentiates
        self.full_load = FullLoadRate(tokens_per_s)  # configured, else measured (0: not yet)
        # (bucket start, adapter -> [requests, tokens]) oldest first
        self._buckets: deque[tuple[float, dict[str, list[int]]]] = deque()

    def record(self, adapter: str, tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        start = now - now % self.bucket_s
        if not self._buckets or self._buckets[-1][0] != start:
            self._buckets.append((start, defaultdict(lambda: [0, 0])))
        counts = self._buckets[-1][1][adapter]
        counts[0] += 1
        counts[1] += tokens
        self.total_tokens += tokens
        self._expire(now)

    def rates(self, now: float | None = None, top: int | None = None) -> dict[str, Demand]:
        """Each adapter's rates: the larger of its rate over the whole window and over the last
        RECENT_BUCKETS buckets, so a rise shows within seconds (the plan adds copies before
        queues build) and a fall fades out linearly as its buckets age out (copies go slowly);
        the `top` busiest by tokens over the window if given."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        recent: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        since = now - RECENT_BUCKETS * self.bucket_s
        first = next((start for start, _ in self._buckets if start >= since), now)
        for start, bucket in self._buckets:
            for adapter, (requests, tokens) in bucket.items():
                totals[adapter][0] += requests
                totals[adapter][1] += tokens
                if start >= since:
                    recent[adapter][0] += requests
                    recent[adapter][1] += tokens
        span = max(now - first, self.bucket_s)  # the recent buckets' time, the current's part
        ranked = sorted(totals.items(), key=lambda kv: (-kv[1][1], kv[0]))[:top]
        return {a: Demand(max(tokens / self.window_s, recent[a][1] / span),
                          max(requests / self.window_s, recent[a][0] / span))
                for a, (requests, tokens) in ranked}

    def _expire(self, now: float) -> None:
        while self._buckets and self._buckets[0][0] <= now - self.window_s:
            self._buckets.popleft()


def published(rates: dict[str, Demand]) -> tuple[tuple[str, float, float], ...]:
    """`rates` as a heartbeat carries them: (adapter, tokens/s, requests/s), busiest first."""
    return tuple((a, d.tokens_per_s, d.requests_per_s) for a, d in rates.items())


def fleet_demand(states: Iterable[ReplicaState]) -> dict[str, Demand]:
    """The fleet's demand: each live replica's published rates, summed per adapter."""
    total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for state in states:
        for adapter, tokens, requests in state.demand:
            total[adapter][0] += tokens
            total[adapter][1] += requests
    return {a: Demand(tokens, requests) for a, (tokens, requests) in total.items()}
