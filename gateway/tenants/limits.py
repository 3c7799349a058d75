"""Per-API-key limits held fleet-wide in one shared Redis, each optional (None: unlimited):

    rpm              admitted iff fewer than rpm requests were admitted in the last WINDOW_S.
    tpm              each admission reserves `tokens` (prompt + max_tokens); admitted iff the
                     reservations of the last WINDOW_S plus `tokens` are <= tpm; finish()
                     corrects a reservation still in the window to the tokens used. tokens > tpm
                     can never fit: refused with too_large=True.
    max_concurrency  admitted iff fewer than max_concurrency leases are live. A lease is a zset
                     member scored by its deadline (now + LEASE_S): renew() moves this replica's
                     on (re-creating those Redis lost with its data, so counts stay right),
                     finish() removes them (a removal Redis refused is retried when it answers
                     again: a lease left behind would lock the key out for LEASE_S), a crashed
                     replica's lapse by themselves.

An admission is one Lua script, one round trip: prune what left the windows, check all three
limits, and only if all pass record all three (a refusal changes nothing). It reads Redis's clock
(TIME), so the replicas' clocks never matter. Keys, under `prefix`, expire TTL_S after their last
write (conc: LEASE_S + WINDOW_S), so idle keys vanish:

    rl:{key_id}:req   zset  request id -> admitted at (ms)
    rl:{key_id}:tok   zset  request id -> admitted at (ms)    } the tpm reservations
    rl:{key_id}:tokn  hash  request id -> tokens reserved     }
    rl:{key_id}:toksum string their sum, kept as they come and go  }
    rl:{key_id}:conc  zset  request id -> lease deadline (ms)

Without Redis, or while it fails, the same windows run in this process (`LocalWindows`,
gateway/tenants/windows.py, with the nouns and the arithmetic both sides share): limits then
hold per replica. After a failure Redis is left alone for RETRY_REDIS_S, so an outage costs one
timeout per RETRY_REDIS_S rather than one per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from loragw.gateway.tenants.windows import (
    UNLIMITED,
    WINDOW_S,
    Decision,
    Limits,
    LocalWindows,
    Reservation,
    Usage,
    decide,
)

if TYPE_CHECKING:
    from redis.asyncio import Redis

logger = logging.getLogger(__name__)

LEASE_S = 60.0
TTL_S = 120.0  # a window's keys outlive their newest member
RETRY_REDIS_S = 1.0  # after a Redis error, decide locally this long before trying it again
FRESH_S = 1.0  # peek() answers from a decision this recent instead of asking Redis again
REDIS_ERRORS = (RedisError, OSError)  # OSError: refused or reset sockets, timeouts

# KEYS: req, tok, tokn, conc, toksum. ARGV: rpm, tpm, max_concurrency ('' = unlimited), request id,
# tokens, window, lease, ttl (ms), '1' to only look (record nothing). Returns {admitted, requests, reset_requests_ms, tokens,
# reset_tokens_ms, in_flight}: counts after this admission; in_flight is before it.
_ADMIT = """
local rpm, tpm, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local rid, tokens = ARGV[4], tonumber(ARGV[5])
local window, lease, ttl = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local look = ARGV[9] == '1'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- the running total of the reservations in the window: each one is added once and taken
-- off once (as it leaves), so an admission costs what left the window, not the window's size
local used = tonumber(redis.call('GET', KEYS[5]) or '0')
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - window)) do
  used = used - (tonumber(redis.call('HGET', KEYS[3], id)) or 0)
  redis.call('HDEL', KEYS[3], id)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
if redis.call('HLEN', KEYS[3]) == 0 or used < 0 then used = 0 end  -- nothing left to sum
local nreq, nconc = redis.call('ZCARD', KEYS[1]), redis.call('ZCARD', KEYS[4])
local ok = not ((rpm and nreq >= rpm) or (tpm and used + tokens > tpm) or (maxc and nconc >= maxc))
local record = ok and not look
local function add(key, score, expire_ms)
  redis.call('ZADD', key, score, rid); redis.call('PEXPIRE', key, expire_ms)
end
if record and rpm then add(KEYS[1], now, ttl); nreq = nreq + 1 end
if record and tpm then
  add(KEYS[2], now, ttl); used = used + tokens
  redis.call('HSET', KEYS[3], rid, tokens); redis.call('PEXPIRE', KEYS[3], ttl)
end
if tpm then redis.call('SET', KEYS[5], used, 'PX', ttl) end
if record and maxc then add(KEYS[4], now + lease, lease + window) end
local req_reset, tok_reset = 0, 0
if rpm and nreq >= rpm then  -- room again when the (nreq - rpm + 1)th oldest leaves
  local at = redis.call('ZRANGE', KEYS[1], nreq - rpm, nreq - rpm, 'WITHSCORES')[2]
  req_reset = at and (tonumber(at) + window - now) or window
end
local need = tpm and math.min(tokens, tpm)
if tpm and used + need > tpm then  -- a request this size fits when enough old ones leave
  tok_reset = window
  local left, ids = used, redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
  for i = 1, #ids, 2 do
    left = left - (tonumber(redis.call('HGET', KEYS[3], ids[i])) or 0)
    if left + need <= tpm then tok_reset = tonumber(ids[i + 1]) + window - now; break end
  end
end
return {ok and 1 or 0, nreq, req_reset, used, tok_reset, nconc}
"""
# KEYS: tokn, conc, toksum. ARGV: request id, tokens used. Corrects only a reservation still in
# the window (and the running total with it).
_FINISH = """
local reserved = redis.call('HGET', KEYS[1], ARGV[1])
if reserved then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  if redis.call('EXISTS', KEYS[3]) == 1 then
    redis.call('INCRBY', KEYS[3], tonumber(ARGV[2]) - tonumber(reserved))
  end
end
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""
# KEYS: one conc key per lease. ARGV: lease, expiry (ms), then one request id per key. A lease
# Redis lost with its data is written again (no XX): the request still runs here. None finished
# meanwhile is brought back: renew and finish take turns (Limiter._turn).
_RENEW = """
local t = redis.call('TIME')
local deadline = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, deadline, ARGV[i + 2]); redis.call('PEXPIRE', key, ARGV[2])
end
return 1
"""


class Limiter:
    """Admits requests under their key's Limits: through `redis` when given and answering, else
    in this process. `request_id` must be unique per request (a member in Redis's sets)."""

    def __init__(self, redis: Redis | None, prefix: str = "loragw:") -> None:
        self._redis, self._prefix = redis, prefix
        self._local = LocalWindows()
        self._leases: dict[tuple[str, str], Reservation] = {}  # admitted via Redis, not finished
        # finished, but Redis refused the release: retried before Redis is asked anything else
        self._unreleased: dict[tuple[str, str], tuple[Reservation, int]] = {}
        # renew and release take turns, so a renew in flight never re-creates a lease that a
        # release has just removed
        self._turn = asyncio.Lock()
        self._last: dict[str, Decision] = {}
        self._last_at: dict[str, float] = {}  # time.monotonic() of each key's last decision
        self._retry_redis_at = 0.0  # time.monotonic() before which Redis is not asked
        self._down = False  # a warning was logged for the current outage
        if redis is not None:
            self._admit, self._finish, self._renew = (
                redis.register_script(s) for s in (_ADMIT, _FINISH, _RENEW))

    def _key(self, key_id: str, name: str) -> str:
        return f"{self._prefix}rl:{key_id}:{name}"

    def _use_redis(self) -> bool:
        return self._redis is not None and time.monotonic() >= self._retry_redis_at

    async def _call(self, script, keys: list[str], args: list) -> list | None:
        """`script`'s answer, or None when Redis failed: one warning per outage, then Redis is
        left alone for RETRY_REDIS_S, so an outage does not cost a timeout per request."""
        try:
            answer = await script(keys, args)
        except REDIS_ERRORS as exc:
            self._retry_redis_at = time.monotonic() + RETRY_REDIS_S
            if not self._down:
                self._down = True
                logger.warning("limits: Redis failed (%s: %s); applying limits per replica "
                               "until it answers again", type(exc).__name__, exc)
            return None
        if self._down:
            self._down = False
            logger.info("limits: Redis answers again; limits hold fleet-wide")
        return answer

    async def _ask(self, key_id: str, limits: Limits, request_id: str, tokens: int,
                   look: bool) -> list | None:
        """The admission script's answer (None: Redis absent or failing)."""
        if not self._use_redis():
            return None
        if self._unreleased and not look:
            await self._retry_releases()  # else a slot Redis still holds would refuse this
            if not self._use_redis():
                return None  # it failed again: decide here, without another timeout
        keys = [self._key(key_id, name) for name in ("req", "tok", "tokn", "conc", "toksum")]
        args = ["" if v is None else v for v in (limits.rpm, limits.tpm, limits.max_concurrency)]
        args += [request_id, tokens, *(round(s * 1000) for s in (WINDOW_S, LEASE_S, TTL_S))]
        return await self._call(self._admit, keys, [*args, "1" if look else "0"])

    async def peek(self, key_id: str, limits: Limits) -> Decision | None:
        """Where `key_id` stands, fleet-wide, taking nothing (the headers of a response that
        admitted nothing): as of at most FRESH_S ago; without Redis, its last decision here."""
        fresh = time.monotonic() - self._last_at.get(key_id, -FRESH_S) < FRESH_S
        answer = None
        if limits.active and not fresh:
            answer = await self._ask(key_id, limits, "", 0, look=True)
        if answer is None:
            return self._last.get(key_id)
        _, requests, req_reset_ms, used, tok_reset_ms, in_flight = answer
        usage = Usage(True, requests, req_reset_ms / 1000, used, tok_reset_ms / 1000, in_flight)
        return self._remember(key_id, decide(limits, 0, usage, None))

    def _remember(self, key_id: str, decision: Decision) -> Decision:
        self._last[key_id], self._last_at[key_id] = decision, time.monotonic()
        return decision

    async def admit(self, key_id: str, limits: Limits, request_id: str, tokens: int) -> Decision:
        assert tokens >= 0, tokens
        if not limits.active:
            self._last[key_id] = UNLIMITED
            return UNLIMITED
        answer = await self._ask(key_id, limits, request_id, tokens, look=False)
        if answer is None:
            usage = self._local.admit(key_id, limits, request_id, tokens)
        else:
            ok, requests, req_reset_ms, used, tok_reset_ms, in_flight = answer
            usage = Usage(bool(ok), requests, req_reset_ms / 1000, used, tok_reset_ms / 1000,
                          in_flight)
        held = limits.tpm is not None or limits.max_concurrency is not None
        reservation = Reservation(key_id, request_id, tokens, local=answer is None, held=held)
        decision = self._remember(key_id, decide(limits, tokens, usage, reservation))
        if decision.admitted and answer is not None and limits.max_concurrency is not None:
            self._leases[key_id, request_id] = reservation
        return decision

    async def finish(self, reservation: Reservation, tokens_used: int) -> None:
        """Release the concurrency slot and correct the tpm reservation to `tokens_used`. Never
        raises: a release Redis refuses is kept and retried when it answers again."""
        if reservation.local:
            self._local.finish(reservation, tokens_used)
            return
        if not reservation.held:
            return  # rpm only: an admission is final, nothing to release (no round trip)
        self._leases.pop((reservation.key_id, reservation.request_id), None)
        # Tried even while Redis is left alone: a leaked slot would refuse requests for LEASE_S.
        async with self._turn:
            if not await self._release(reservation, tokens_used):
                self._unreleased[reservation.key_id, reservation.request_id] = (
                    reservation, tokens_used)

    async def _release(self, reservation: Reservation, tokens_used: int) -> bool:
        """One release in Redis (idempotent: a retry changes nothing twice); False if it failed."""
        keys = [self._key(reservation.key_id, name) for name in ("tokn", "conc", "toksum")]
        return await self._call(self._finish, keys, [reservation.request_id, tokens_used]) \
            is not None

    async def _retry_releases(self) -> None:
        """The releases Redis refused, in the order they came; stops at the first failure."""
        async with self._turn:
            done = 0
            while self._unreleased:
                key, (reservation, used) = next(iter(self._unreleased.items()))
                if not await self._release(reservation, used):
                    return
                self._unreleased.pop(key, None)
                done += 1
            if done:
                logger.info("limits: %d release(s) Redis refused, done now", done)

    async def renew(self) -> None:
        """Retry the releases Redis refused, then extend (re-create, where Redis lost them) the
        leases of every request admitted here through Redis and not finished, in one round
        trip. Never raises."""
        if not self._use_redis():
            return
        if self._unreleased:
            await self._retry_releases()
        async with self._turn:
            if self._leases and self._use_redis():
                leases = list(self._leases.values())
                args = [round(LEASE_S * 1000), round((LEASE_S + WINDOW_S) * 1000),
                        *(r.request_id for r in leases)]
                await self._call(self._renew, [self._key(r.key_id, "conc") for r in leases],
                                 args)

    def last(self, key_id: str) -> Decision | None:
        """The most recent Decision for `key_id` made here."""
        return self._last.get(key_id)
