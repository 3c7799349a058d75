"""Where the fleet's aliases are kept, and this replica's copy of them.

With --redis-url: one Redis hash, `{prefix}aliases` (alias -> Alias JSON), under the
registry's prefix, and a marker `{prefix}aliases:kept` written with every change: Redis without
it while a replica holds aliases has lost its data (restarted empty), and that replica writes
back the aliases it holds, as the catalog and the keys are; without: a dict in this process.
`AliasBook` mirrors the store in a map that every heartbeat (and every admin read) replaces
whole by a fresh read, so a request sees one alias map or the next, never a mix, and a PUT on
any replica is followed by every replica within one heartbeat. Redis away: the last map read
keeps serving; only changes fail (AliasesUnavailable, 503).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from loragw.adapters.aliases import Alias, AliasesUnavailable, choose

logger = logging.getLogger(__name__)

REDIS_TIMEOUT_S = 1.0  # a read that takes longer is an outage: serve the last map
REDIS_ERRORS = (RedisError, OSError)
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(Alias).decode


class RedisAliasStore:
    def __init__(self, url: str, prefix: str):
        self.redis = Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S,
                                    socket_connect_timeout=REDIS_TIMEOUT_S)
        self.key, self.kept_key = f"{prefix}aliases", f"{prefix}aliases:kept"

    async def read_all(self) -> tuple[dict[str, Alias], bool]:
        """The aliases, and whether Redis kept them (False: it lost its data, or none was
        ever written)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(self.key)
            pipe.exists(self.kept_key)
            raw, kept = await pipe.execute()
        out = {}
        for value in raw.values():
            try:
                alias = _decode(value)
            except msgspec.DecodeError:
                continue  # written by an incompatible version: not an alias we can honour
            out[alias.alias] = alias
        return out, bool(kept)

    async def put(self, alias: Alias) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.key, alias.alias, _encode(alias))
            pipe.set(self.kept_key, 1)
            await pipe.execute()

    async def delete(self, name: str) -> bool:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self.key, name)
            pipe.set(self.kept_key, 1)
            found, _ = await pipe.execute()
        return bool(found)

    async def restore(self, aliases: dict[str, Alias]) -> None:
        """Write back what a replica holds after Redis lost its data, unless someone did."""
        async with self.redis.pipeline(transaction=True) as pipe:
            for alias in aliases.values():
                pipe.hsetnx(self.key, alias.alias, _encode(alias))
            pipe.set(self.kept_key, 1)
            await pipe.execute()

    async def close(self) -> None:
        await self.redis.aclose()


class InProcessAliasStore:
    def __init__(self):
        self._aliases: dict[str, Alias] = {}

    async def read_all(self) -> tuple[dict[str, Alias], bool]:
        return dict(self._aliases), True

    async def put(self, alias: Alias) -> None:
        self._aliases[alias.alias] = alias

    async def delete(self, name: str) -> bool:
        return self._aliases.pop(name, None) is not None

    async def restore(self, aliases: dict[str, Alias]) -> None:
        pass  # this process is the store: nothing to lose

    async def close(self) -> None:
        pass


class AliasBook:
    """This replica's aliases. `resolve` is the request path's one call: no I/O."""

    def __init__(self, store: RedisAliasStore | InProcessAliasStore):
        self.store = store
        self._aliases: dict[str, Alias] = {}
        self._writes = 0  # bumped by this replica's changes: a read begun before one is stale
        self._away = False  # Redis did not answer the last read (logged once per outage)

    @classmethod
    def open(cls, redis_url: str | None, prefix: str = "loragw:") -> AliasBook:
        """Kept in Redis under the registry's `prefix` when `redis_url` is set, else here."""
        return cls(RedisAliasStore(redis_url, prefix) if redis_url else InProcessAliasStore())

    async def sync(self) -> None:
        """Replace the map by the store's; on an outage keep the last one; write back the
        map to a store that lost its data."""
        writes = self._writes
        try:
            fresh, kept = await self.store.read_all()
            if not kept and self._aliases:
                logger.warning("aliases: Redis lost its data; writing back the %d alias(es) "
                               "this replica holds", len(self._aliases))
                await self.store.restore(self._aliases)
                fresh, _ = await self.store.read_all()
        except REDIS_ERRORS as exc:
            if not self._away:
                logger.warning("aliases: Redis does not answer (%s); serving the %d alias(es) "
                               "last read", exc, len(self._aliases))
            self._away = True
            return
        if self._away:
            logger.info("aliases: Redis answers again; %d alias(es)", len(fresh))
        self._away = False
        if writes == self._writes:  # else a change of ours landed meanwhile: the next read
            self._aliases = fresh

    def get(self, name: str) -> Alias | None:
        return self._aliases.get(name)

    def all(self) -> list[Alias]:
        return sorted(self._aliases.values(), key=lambda a: a.alias)

    async def put(self, alias: Alias) -> None:
        await self._write(self.store.put(alias))
        self._aliases = {**self._aliases, alias.alias: alias}

    async def delete(self, name: str) -> bool:
        found = await self._write(self.store.delete(name))
        self._aliases = {k: v for k, v in self._aliases.items() if k != name}
        return found

    async def _write(self, change):
        self._writes += 1
        try:
            return await change
        except REDIS_ERRORS as exc:
            raise AliasesUnavailable(f"the fleet's aliases are kept in Redis, which does not "
                                     f"answer ({exc}); retry when it is back") from None

    def resolve(self, model: str, user: str | None,
                usable: Callable[[Alias], bool] = lambda alias: True,
                rng: random.Random | None = None, chosen: str | None = None) -> str:
        """The target a request for `model` goes to, if `model` is an alias the caller may
        use (`usable(alias)`, gateway/residency/aliases.py); else `model` itself (an alias
        the caller may not use is answered as a name that does not exist). `chosen`: the
        target the replica that forwarded the request drew, kept while it is still one of
        the alias's live targets."""
        alias = self._aliases.get(model)
        if alias is None or not usable(alias):
            return model
        if chosen is not None and any(t.adapter == chosen and t.weight > 0
                                      for t in alias.targets):
            return chosen
        return choose(alias, user, rng)

    async def close(self) -> None:
        await self.store.close()
