"""The nouns of a key's limits (`Limits`, `Reservation`, `Decision`), the arithmetic that turns
window counts into a decision and OpenAI's x-ratelimit-* headers, and the same three windows
held in this process (`LocalWindows`): the limiter's fallback when Redis is absent or failing
(gateway/tenants/limits.py holds the Redis side and the algorithm's description).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

WINDOW_S = 60.0
CONCURRENCY_RETRY_S = 1.0  # when a slot frees is unknown: a guess, never below a second


@dataclass(frozen=True, slots=True)
class Limits:
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "max_concurrency"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} is {value}; give a count >= 0, or None for no limit")

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.rpm, self.tpm, self.max_concurrency))


@dataclass(frozen=True, slots=True)
class Reservation:
    """What finish() needs back."""

    key_id: str
    request_id: str
    tokens: int
    local: bool  # admitted by the in-process fallback: finish it there
    held: bool = True  # a tpm reservation or a concurrency slot to settle (rpm alone: nothing)


@dataclass(frozen=True, slots=True)
class Decision:
    admitted: bool
    limit: str | None  # when refused: "requests" | "tokens" | "concurrency"
    retry_after_s: float  # when refused; 0 when too_large (no retry can succeed)
    remaining_requests: int | None  # None when rpm is None
    reset_requests_s: float  # until the request window has room again (0: it has)
    remaining_tokens: int | None
    reset_tokens_s: float  # until a request of this size fits again (0: it does)
    reservation: Reservation | None  # when admitted
    too_large: bool = False  # tokens > tpm: can never be admitted


UNLIMITED = Decision(True, None, 0.0, None, 0.0, None, 0.0, None)


class Usage(NamedTuple):
    """One admission as either path saw it: counts after it, in_flight before it."""

    admitted: bool
    requests: int
    reset_requests_s: float
    tokens: int
    reset_tokens_s: float
    in_flight: int


def over(limits: Limits, tokens: int, requests: int, used: int, in_flight: int) -> list[str]:
    """The limits that one more request of `tokens` would break, in the order a refusal names
    them (the Lua script states the same rule)."""
    return [name for name, limit, count in (("requests", limits.rpm, requests + 1),
                                            ("tokens", limits.tpm, used + tokens),
                                            ("concurrency", limits.max_concurrency, in_flight + 1))
            if limit is not None and count > limit]


def decide(limits: Limits, tokens: int, usage: Usage, reservation: Reservation) -> Decision:
    """The Decision for `usage`. A refusal names the first limit broken, and may be retried when
    the last of them has room; too_large names tokens, and no retry can succeed."""
    limit, retry, too_large = None, 0.0, False
    if not usage.admitted:
        broken = over(limits, tokens, usage.requests, usage.tokens, usage.in_flight)
        assert broken, f"refused with room under every limit: {limits} {usage}"
        waits = {"requests": usage.reset_requests_s, "tokens": usage.reset_tokens_s,
                 "concurrency": CONCURRENCY_RETRY_S}
        too_large = limits.tpm is not None and tokens > limits.tpm
        limit = "tokens" if too_large else broken[0]
        retry = 0.0 if too_large else max(waits[name] for name in broken)
    rpm, tpm = limits.rpm, limits.tpm
    return Decision(
        usage.admitted, limit, retry,
        None if rpm is None else max(0, rpm - usage.requests), usage.reset_requests_s,
        None if tpm is None else max(0, tpm - usage.tokens), usage.reset_tokens_s,
        reservation if usage.admitted else None, too_large)


def format_reset(seconds: float) -> str:
    """As OpenAI writes resets (Go's durations): "0s", "20ms", "1s", "1.5s", "6m0s", "1h0m0s".
    Rounded up to the millisecond: a client that waits this long is never early."""
    ms = math.ceil(round(seconds * 1000, 6))
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s = f"{rest // 1000}" + (f".{rest % 1000:03d}".rstrip("0") if rest % 1000 else "")
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{s}s"


def rate_limit_headers(limits: Limits, decision: Decision) -> dict[str, str]:
    """OpenAI's x-ratelimit-{limit,remaining,reset}-requests (when rpm is set) and -tokens (when
    tpm is set)."""
    headers = {}
    for name, limit, remaining, reset in (
            ("requests", limits.rpm, decision.remaining_requests, decision.reset_requests_s),
            ("tokens", limits.tpm, decision.remaining_tokens, decision.reset_tokens_s)):
        if limit is not None and remaining is not None:  # None: decided under other limits
            headers[f"x-ratelimit-limit-{name}"] = str(limit)
            headers[f"x-ratelimit-remaining-{name}"] = str(remaining)
            headers[f"x-ratelimit-reset-{name}"] = format_reset(reset)
    return headers


@dataclass(slots=True)
class _Windows:
    """One key's windows in this process (times from time.monotonic)."""

    requests: deque[float] = field(default_factory=deque)
    reservations: deque[tuple[float, str]] = field(default_factory=deque)
    tokens: dict[str, int] = field(default_factory=dict)
    in_flight: set[str] = field(default_factory=set)


class LocalWindows:
    """The same three limits in this process: the fallback when Redis is absent or failing."""

    def __init__(self) -> None:
        self._keys: dict[str, _Windows] = {}

    def admit(self, key_id: str, limits: Limits, request_id: str, tokens: int) -> Usage:
        w = self._keys.setdefault(key_id, _Windows())
        now = time.monotonic()
        while w.requests and w.requests[0] <= now - WINDOW_S:
            w.requests.popleft()
        while w.reservations and w.reservations[0][0] <= now - WINDOW_S:
            w.tokens.pop(w.reservations.popleft()[1], None)
        used, in_flight = sum(w.tokens.values()), len(w.in_flight)
        ok = not over(limits, tokens, len(w.requests), used, in_flight)
        if ok:
            if limits.rpm is not None:
                w.requests.append(now)
            if limits.tpm is not None:
                w.reservations.append((now, request_id))
                w.tokens[request_id] = tokens
                used += tokens
            if limits.max_concurrency is not None:
                w.in_flight.add(request_id)
        req_reset = tok_reset = 0.0
        if limits.rpm is not None and len(w.requests) >= limits.rpm:
            index = len(w.requests) - limits.rpm
            req_reset = w.requests[index] + WINDOW_S - now if index < len(w.requests) else WINDOW_S
        if limits.tpm is not None and used + min(tokens, limits.tpm) > limits.tpm:
            need, left, tok_reset = min(tokens, limits.tpm), used, WINDOW_S
            for at, rid in w.reservations:
                left -= w.tokens.get(rid, 0)
                if left + need <= limits.tpm:
                    tok_reset = at + WINDOW_S - now
                    break
        return Usage(ok, len(w.requests), req_reset, used, tok_reset, in_flight)

    def finish(self, reservation: Reservation, tokens_used: int) -> None:
        w = self._keys.get(reservation.key_id)
        if w is not None:
            w.in_flight.discard(reservation.request_id)
            if reservation.request_id in w.tokens:  # still inside the window
                w.tokens[reservation.request_id] = tokens_used
