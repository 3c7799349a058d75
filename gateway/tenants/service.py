"""`Tenants`: the keyring, the limiter, the audit log and the fleet's forwarding secret of one
replica, started before anything else in Services and kept current by a heartbeat of its own
(`HEARTBEAT_S`): keys re-read when they changed anywhere, concurrency leases renewed (and
releases Redis refused retried), last uses flushed, audit entries Redis lost put back. With
--redis-url all of it lives in Redis (keys, limits, audit: fleet-wide; the audit also in each
replica's own file); without, keys and audit live in `<adapter dir>/.tenants/` and limits in
this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from loragw.gateway.common.config import ServerConfig
from loragw.gateway.common.errors import APIError
from loragw.gateway.common.tasks import spawn
from loragw.gateway.observe.metrics import Metrics
from loragw.gateway.tenants.audit import AuditLog
from loragw.gateway.tenants.forwarding import fleet_secret
from loragw.gateway.tenants.key_store import FileKeyStore, RedisKeyStore
from loragw.gateway.tenants.keyring import KeyRing
from loragw.gateway.tenants.keys import Principal
from loragw.gateway.tenants.limits import Limiter
from loragw.gateway.tenants.windows import Decision, Reservation, rate_limit_headers

logger = logging.getLogger(__name__)
PREFIX = "loragw:"  # the registry's prefix (adapters.registry)
HEARTBEAT_S = 1.0  # a revoked key is refused everywhere within this (plus a Redis read)
REDIS_TIMEOUT_S = 1.0


class Tenants:
    def __init__(self, config: ServerConfig, metrics: Metrics):
        self.metrics = metrics
        folder = os.path.join(config.adapter_path, ".tenants")
        self.redis = (Redis.from_url(config.redis_url, socket_timeout=REDIS_TIMEOUT_S,
                                     socket_connect_timeout=REDIS_TIMEOUT_S,
                                     retry=Retry(NoBackoff(), 1))
                      if config.redis_url else None)
        store = RedisKeyStore(self.redis, PREFIX) if self.redis else FileKeyStore(folder)
        self.keys = KeyRing(store, config.tenant_key_cache_s)
        self.limiter = Limiter(self.redis, PREFIX)
        self.audit = AuditLog(folder, self.redis, PREFIX)
        self.forward_secret: bytes | None = None  # None: not read from Redis yet
        self.started = False
        self._beat: asyncio.Task | None = None

    async def start(self) -> None:
        await self.keys.sync()
        await self._read_secret()
        await self.audit.sync()
        self._beat = asyncio.create_task(self._heartbeat(), name="tenants-heartbeat")
        self.started = True
        logger.info("tenant keys: %d known (%s)", len(self.keys.records),
                    "Redis" if self.redis else self.audit.folder)

    async def close(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat
        if self.redis is not None:
            await self.redis.aclose()

    async def find(self, secret: str) -> Principal | None:
        """The tenant key `secret` opens (the mirror, then the store on a miss)."""
        record = await self.keys.find(secret)
        return Principal.of(record) if record is not None else None

    async def admit(self, caller: Principal, request_id: str,
                    tokens: int) -> tuple[Reservation | None, dict[str, str]]:
        """Take `tokens` (prompt + max_tokens) and a request from the caller's limits, fleet
        wide: (the reservation to finish, the x-ratelimit-* headers); 429 over a limit."""
        limits = caller.limits
        if not limits.active:
            return None, {}
        decision = await self.limiter.admit(caller.key_id, limits, request_id, tokens)
        headers = rate_limit_headers(limits, decision)
        if not decision.admitted:
            self.metrics.tenant_rate_limited.labels(caller.metrics_label, decision.limit).inc()
            raise APIError.rate_limited(_refusal(caller, decision, tokens),
                                        decision.retry_after_s, headers)
        return decision.reservation, headers

    def finish(self, tenant: str, prompt: int, completion: int,
               reservation: Reservation | None) -> None:
        """A request of `tenant` ended, having used `prompt` and `completion` tokens: counted,
        and its reservation (if its key has limits) corrected and released."""
        self.metrics.tenant_tokens.labels(tenant, "prompt").inc(prompt)
        self.metrics.tenant_tokens.labels(tenant, "completion").inc(completion)
        if reservation is not None:
            spawn(self.limiter.finish(reservation, prompt + completion))

    async def by_id(self, key_id: str) -> Principal | None:
        """The key a forwarded request names (the store on a miss: minted a moment ago)."""
        record = await self.keys.by_id_fresh(key_id)
        return Principal.of(record) if record is not None else None

    async def _read_secret(self) -> None:
        """Read the fleet's secret, or put it back (every heartbeat) if Redis lost it, so a
        replica started after that shares it too."""
        if self.redis is None:
            return
        try:
            self.forward_secret = await fleet_secret(self.redis, PREFIX, self.forward_secret)
        except Exception as exc:  # noqa: BLE001 (Redis away: no forwarding is possible anyway)
            logger.warning("tenants: cannot read the fleet's forwarding secret yet: %s", exc)

    async def headers(self, caller: Principal) -> dict[str, str]:
        """The x-ratelimit-* headers of a limited key's response that took nothing from its
        limits (a list, an error before admission): where the key stands, fleet-wide."""
        now = await self.limiter.peek(caller.key_id, caller.limits)
        return rate_limit_headers(caller.limits, now) if now is not None else {}

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self.keys.sync()
                await self.limiter.renew()
                await self._read_secret()
                await self.audit.sync()
            except Exception:  # a bug must not stop revocations from arriving
                logger.exception("tenants heartbeat failed")


def _refusal(caller: Principal, decision: Decision, tokens: int) -> str:
    limits, key = caller.limits, caller.key_id
    if decision.limit == "tokens" and decision.too_large:
        return (f"this request reserves {tokens} tokens (prompt + max_tokens) and key {key} "
                f"may use {limits.tpm} tokens per minute; lower max_tokens or shorten the prompt")
    wait = f"retry after {max(1, round(decision.retry_after_s))} s"
    if decision.limit == "tokens":
        return f"rate limit reached for key {key}: {limits.tpm} tokens per minute; {wait}"
    if decision.limit == "concurrency":
        return (f"key {key} already has {limits.max_concurrency} requests in flight (its "
                f"max_concurrency); {wait}, or when one ends")
    return f"rate limit reached for key {key}: {limits.rpm} requests per minute; {wait}"
