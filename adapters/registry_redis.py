"""RedisRegistry: the registry a fleet of replicas shares through one Redis (``--redis-url``).

What it keeps in Redis, and how each write stays atomic: adapters.redis_layout. When Redis is away
the replica keeps serving: reads answer from the last known catalog (and ``replicas()`` from this
replica alone, so the router serves locally), writes queue up, ``healthy`` is False, and a
reconnect loop retries with capped exponential backoff. When Redis answers again, even empty,
the replica re-subscribes, restores every entry it knows (the catalog is whole again if one
replica knew each entry), replays its queued writes and re-registers, within one heartbeat. A
read under a new epoch (Redis restarted empty) rejoins first: a lost entry never reads as gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from loragw.adapters.redis_layout import RedisLayout
from loragw.adapters.registry_types import (
    AdapterEvent,
    CatalogEntry,
    EventCallback,
    ReplicaState,
    catalog_changes,
    decode_all,
    decode_event,
    deliver,
    stamp,
)

logger = logging.getLogger(__name__)

REDIS_ERRORS = (RedisError, OSError)  # OSError covers refused/reset sockets and timeouts
_NOTHING = object()
T = TypeVar("T")


class RedisRegistry:
    """The ``Registry`` over Redis. ``close(deregister=False)`` leaves as a crash would."""

    def __init__(
        self,
        url: str,
        replica_id: str,
        *,
        heartbeat_s: float = 2.0,
        ttl_s: float = 6.0,
        prefix: str = "loragw:",
        timeout_s: float = 1.0,
        backoff_s: tuple[float, float] = (0.1, 2.0),
    ) -> None:
        if not 0 < heartbeat_s < ttl_s:
            raise ValueError(
                f"ttl_s={ttl_s} must exceed heartbeat_s={heartbeat_s} > 0, or live replicas "
                "expire between heartbeats; use e.g. ttl_s = 3 * heartbeat_s"
            )
        self.replica_id = replica_id
        self._heartbeat_s, self._ttl_ms = heartbeat_s, int(ttl_s * 1000)
        # Capped at half a heartbeat so a returning Redis is noticed within one heartbeat.
        self._backoff_max = min(backoff_s[1], heartbeat_s / 2)
        self._backoff_min = min(backoff_s[0], self._backoff_max)
        # One quick retry on a fresh connection, then report: calls never wait out a dead Redis.
        retry, t = Retry(NoBackoff(), 1), timeout_s
        self._redis = Redis.from_url(url, socket_timeout=t, socket_connect_timeout=t, retry=retry)
        self._where = url.rpartition("@")[2]  # for logs: no password
        self._layout = RedisLayout(self._redis, prefix)

        self._healthy = False
        self._closing = False
        self._epoch: bytes | None = None  # the epoch token last seen; None before first contact
        self._catalog: dict[str, CatalogEntry] = {}  # last known catalog, served while away
        self._own: dict[str, CatalogEntry] = {}  # entries this replica wrote: restored on loss
        self._pending: dict[str, CatalogEntry | None] = {}  # writes made while away; None = delete
        self._state: ReplicaState | None = None
        self._callbacks: list[EventCallback] = []
        self._sync_lock = asyncio.Lock()
        self._pubsub: PubSub | None = None
        self._listener: asyncio.Task | None = None
        self._heartbeat: asyncio.Task | None = None
        self._reconnect: asyncio.Task | None = None

    @property
    def healthy(self) -> bool:
        return self._healthy

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and start heartbeating. An unreachable Redis is retried in the background."""
        self._heartbeat = asyncio.create_task(self._heartbeat_loop(), name="registry-heartbeat")
        try:
            await self._sync()
            logger.info("registry: %s joined Redis %s", self.replica_id, self._where)
        except REDIS_ERRORS as exc:
            self._go_down(exc)

    async def close(self, *, deregister: bool = True) -> None:
        """Stop background work; with ``deregister`` remove this replica's state at once."""
        self._closing = True
        tasks = [t for t in (self._heartbeat, self._reconnect, self._listener) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._close_pubsub()
        if deregister and self._healthy:
            with contextlib.suppress(*REDIS_ERRORS):
                await self._layout.remove_state(self.replica_id)
        if self._pending:
            logger.warning("registry: closing; Redis never got writes to %s", sorted(self._pending))
        self._healthy = False
        await self._redis.aclose()

    # -- catalog ----------------------------------------------------------------------------

    async def put_adapter(self, entry: CatalogEntry) -> None:
        self._catalog[entry.adapter_id] = self._own[entry.adapter_id] = entry
        ok, _ = await self._attempt(lambda: self._apply(entry.adapter_id, entry))
        if not ok:
            self._pending[entry.adapter_id] = entry

    async def get_adapter(self, adapter_id: str) -> CatalogEntry | None:
        ok, entry = await self._attempt(lambda: self._current(
            lambda: self._layout.read_entry(adapter_id)))
        if not ok:
            return self._catalog.get(adapter_id)
        if entry is None:
            self._catalog.pop(adapter_id, None)
            return None
        self._catalog[adapter_id] = entry
        return entry

    async def list_adapters(self) -> list[CatalogEntry]:
        ok, fresh = await self._attempt(lambda: self._current(self._layout.read_catalog))
        if ok:
            self._catalog = fresh
        return sorted(self._catalog.values(), key=lambda e: e.adapter_id)

    async def delete_adapter(self, adapter_id: str) -> bool:
        known = self._catalog.pop(adapter_id, None) is not None
        self._own.pop(adapter_id, None)
        ok, deleted = await self._attempt(lambda: self._apply(adapter_id, None))
        if not ok:
            self._pending[adapter_id] = None
        return deleted if ok else known

    # -- replicas and events ----------------------------------------------------------------

    async def publish_state(self, state: ReplicaState) -> None:
        assert state.replica_id == self.replica_id, (state.replica_id, self.replica_id)
        self._state = state  # written now, or when Redis returns
        await self._attempt(self._write_state)

    async def replicas(self) -> list[ReplicaState]:
        """Live replicas, this one included; only this one while Redis is away."""
        ok, live = await self._attempt(self._layout.live_replicas)
        if ok:
            return live
        return [self._state] if self._state is not None else []

    def subscribe(self, callback: EventCallback) -> None:
        self._callbacks.append(callback)

    # -- internals --------------------------------------------------------------------------

    async def _attempt(self, call: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
        """``(True, await call())`` while Redis answers; else ``(False, None)``, never raising."""
        if not self._healthy:
            return False, None
        try:
            return True, await call()
        except REDIS_ERRORS as exc:
            self._go_down(exc)
            return False, None

    async def _current(self, read: Callable[[], Awaitable[tuple[T, bytes | None]]]) -> T:
        """`read()`'s value under the epoch we know (a new one: rejoin, restore, read again)."""
        value, epoch = await read()
        if epoch != self._epoch:
            await self._sync()
            value, _ = await read()
        return value

    async def _apply(self, adapter_id: str, entry: CatalogEntry | None) -> bool:
        """Write one catalog change (None = delete) as this replica, announced to the fleet."""
        return await self._layout.write_entry(adapter_id, entry, origin=self.replica_id)

    async def _write_state(self) -> bytes | None:
        """Store this replica's state with a fresh expiry; returns the epoch token seen."""
        if self._state is None:
            return await self._layout.read_epoch()
        self._state = stamp(self._state)
        return await self._layout.write_state(self._state, self._ttl_ms)

    async def _sync(self) -> None:
        """(Re)join Redis: subscribe, restore lost entries, replay queued writes, re-register."""
        async with self._sync_lock:
            await self._close_pubsub()
            self._pubsub = self._redis.pubsub()
            # Subscribed before replaying, so we hear our own events.
            await self._pubsub.subscribe(self._layout.events_channel)
            self._listener = asyncio.create_task(self._listen(self._pubsub), name="registry-events")

            epoch = await self._layout.claim_epoch()
            lost = self._epoch is not None and epoch != self._epoch
            self._epoch = epoch
            if lost:  # Redis came back empty: put back what we know, unless someone already did
                logger.warning("registry: Redis %s lost its data; restoring the catalog",
                               self._where)
                await self._layout.restore_entries({**self._catalog, **self._own})
            await self._replay()
            await self._write_state()
            fresh, _ = await self._layout.read_catalog()
            missed = [] if lost else list(catalog_changes(self._catalog, fresh))
            self._catalog = {**self._catalog, **fresh} if lost else fresh
            await self._replay()  # writes queued while we were fetching
            self._healthy = True  # no await since the last replay found the queue empty
        for event in missed:  # announcements sent while we were not listening
            await self._on_event(event)

    async def _replay(self) -> None:
        while self._pending:
            adapter_id, entry = next(iter(self._pending.items()))
            await self._apply(adapter_id, entry)
            if self._pending.get(adapter_id, _NOTHING) is entry:  # not superseded meanwhile
                del self._pending[adapter_id]
                if entry is not None:
                    self._catalog[adapter_id] = entry

    def _go_down(self, exc: BaseException) -> None:
        if self._closing:
            return
        if self._healthy:
            logger.warning("registry: lost Redis %s: %s; serving locally", self._where, exc)
        self._healthy = False
        if self._reconnect is None or self._reconnect.done():
            self._reconnect = asyncio.create_task(self._reconnect_loop(), name="registry-reconnect")

    async def _reconnect_loop(self) -> None:
        delay = self._backoff_min
        while not self._closing:
            await asyncio.sleep(delay)
            try:
                await self._sync()
            except REDIS_ERRORS as exc:
                logger.debug("registry: Redis %s still unreachable: %s", self._where, exc)
            except Exception:
                logger.exception("registry: unexpected error rejoining Redis %s", self._where)
            else:
                logger.info("registry: %s rejoined Redis %s", self.replica_id, self._where)
                return
            delay = min(2 * delay, self._backoff_max)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            if not self._healthy:
                continue  # the reconnect loop owns the way back
            try:
                if await self._write_state() != self._epoch:
                    await self._sync()  # Redis restarted (and maybe lost our data) between beats
            except REDIS_ERRORS as exc:
                self._go_down(exc)
            except Exception:  # a bug must not stop the heartbeat: the replica would expire
                logger.exception("registry: heartbeat failed")

    async def _listen(self, pubsub: PubSub) -> None:
        try:
            while True:
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if msg is None or msg["type"] != "message":
                    continue
                for event in decode_all(decode_event, [msg["data"]]):
                    await self._on_event(event)
        except REDIS_ERRORS as exc:
            self._go_down(exc)

    async def _on_event(self, event: AdapterEvent) -> None:
        if event.origin != self.replica_id:  # another replica now owns (or removed) this id
            self._own.pop(event.adapter_id, None)
            self._catalog.pop(event.adapter_id, None)
        await deliver(self._callbacks, event)

    async def _close_pubsub(self) -> None:
        if self._listener is not None and self._listener is not asyncio.current_task():
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, *REDIS_ERRORS):
                await self._listener
        self._listener = None
        if self._pubsub is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                await self._pubsub.aclose()
            self._pubsub = None
