"""This replica's mirror of the tenant keys, and the key operations the admin API calls.

Authorizing a request reads only the mirror (a dict lookup on the secret's sha256: no Redis
round trip). The mirror follows the store every heartbeat (`sync`: one GET of the version,
a full read when it moved), so a key revoked or rotated on any replica is refused here within a
heartbeat; a key minted elsewhere moments ago is read from the store on its first miss. While
the store cannot be read, the mirror keeps authorizing the keys it holds, for at most
`offline_s` after the last successful read, and refuses every key it does not hold (fail
closed); writes (mint, rotate, revoke) fail with 503 and change nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from loragw.gateway.common.errors import APIError
from loragw.gateway.tenants.keys import KeyRecord, digest, new_key_id, new_secret
from loragw.gateway.tenants.windows import Limits

logger = logging.getLogger(__name__)
STORE_ERRORS = (OSError, ConnectionError, TimeoutError)


def store_errors() -> tuple[type[BaseException], ...]:
    from redis.exceptions import RedisError
    return (*STORE_ERRORS, RedisError)


class KeyRing:
    def __init__(self, store, offline_s: float):
        self.store, self.offline_s = store, offline_s
        self.records: dict[str, KeyRecord] = {}
        self._by_hash: dict[str, str] = {}
        self._version: str | None = None
        self._confirmed = 0.0  # time.monotonic() of the last successful read of the store
        self._used: dict[str, float] = {}  # last uses seen here, not yet flushed
        self._errors = store_errors()
        self._away = False  # the last sync could not read the store

    # ---- the request path ----------------------------------------------------------------
    async def find(self, secret: str) -> KeyRecord | None:
        """The key `secret` opens: from the mirror while it is trusted, else (a miss: a key
        minted elsewhere a moment ago) from the store itself."""
        hashed = digest(secret)
        record = self._opened(self.records.get(self._by_hash.get(hashed, "")), hashed)
        if record is not None:
            return record
        try:
            record = await self.store.lookup(hashed)
        except self._errors:
            return None  # unknown, and nobody to ask: refused
        if record is None or hashed not in record.hashes():
            return None
        self._remember(record)
        self._used[record.id] = time.time()
        return record

    async def by_id_fresh(self, key_id: str) -> KeyRecord | None:
        """A key by id (a request another replica forwards names its key by id): the mirror,
        then the store on a miss."""
        if not self._trusted():
            return None
        record = self.records.get(key_id)
        if record is None:
            try:
                record = await self.store.get(key_id)
            except self._errors:
                return None
            if record is not None:
                self._remember(record)
        return record

    def _trusted(self) -> bool:
        """The mirror was read from the store within offline_s."""
        return time.monotonic() - self._confirmed <= self.offline_s

    def _opened(self, record: KeyRecord | None, hashed: str) -> KeyRecord | None:
        """`record` if the secret hashed to `hashed` opens it now (its current or in-grace
        secret) and the mirror is trusted; its use is noted for the next flush."""
        if record is None or not self._trusted() or hashed not in record.hashes():
            return None
        self._used[record.id] = time.time()
        return record

    # ---- keeping current -----------------------------------------------------------------
    async def sync(self) -> None:
        """Follow the store (every heartbeat); flush last uses; restore a store that lost its
        data. Never raises: an unreachable store leaves the mirror as it is."""
        try:
            version = await self.store.version()
            if version is None and self.records:
                logger.warning("tenant keys: the store lost its data; writing back the %d "
                               "key(s) this replica knows", len(self.records))
                await self.store.restore(self.records)
                version = "restored"
            if version != self._version:
                records, self._version = await self.store.load()
                self._replace(records)
            self._confirmed = time.monotonic()
            used, self._used = self._used, {}
            await self.store.touch(used)
            if self._away:
                logger.info("tenant keys: the store answers again (%d keys)", len(self.records))
            self._away = False
        except self._errors as exc:
            if not self._away:  # once per outage
                logger.warning("tenant keys: store unreachable (%s); honouring the %d known "
                               "key(s) for at most %.0f s, refusing every other key", exc,
                               len(self.records),
                               self.offline_s - (time.monotonic() - self._confirmed))
            self._away = True

    def _replace(self, records: dict[str, KeyRecord]) -> None:
        self.records = records
        self._by_hash = {}
        for record in records.values():
            self._index(record)

    def _remember(self, record: KeyRecord) -> None:
        self.records[record.id] = record
        self._index(record)

    def _index(self, record: KeyRecord) -> None:
        for h in (record.hash, record.old_hash):
            if h:
                self._by_hash[h] = record.id

    # ---- the admin API -------------------------------------------------------------------
    async def create(self, tenant: str, role: str, adapters: tuple[str, ...],
                     limits: Limits) -> tuple[KeyRecord, str]:
        secret = new_secret()
        record = KeyRecord(new_key_id(), tenant, role, adapters, limits.rpm, limits.tpm,
                           limits.max_concurrency, int(time.time()), digest(secret))
        await self._write(self.store.put(record))
        self._remember(record)
        return record, secret

    async def rotate(self, record: KeyRecord, grace_s: float) -> tuple[KeyRecord, str]:
        """A new secret; the current one keeps working for `grace_s` (0: stops now)."""
        secret = new_secret()
        dropped = tuple(h for h in (record.old_hash,) if h)
        new = replace(record, hash=digest(secret), old_hash=record.hash if grace_s > 0 else "",
                      old_until=time.time() + grace_s if grace_s > 0 else 0.0)
        await self._write(self.store.put(new, dropped + (() if grace_s > 0 else (record.hash,))))
        for h in dropped + ((record.hash,) if grace_s <= 0 else ()):
            self._by_hash.pop(h, None)
        self._remember(new)
        return new, secret

    async def revoke(self, record: KeyRecord) -> None:
        await self._write(self.store.delete(record))
        self.records.pop(record.id, None)
        for h in (record.hash, record.old_hash):
            self._by_hash.pop(h, None)

    async def last_used(self) -> dict[str, float]:
        try:
            stored = await self.store.last_used()
        except self._errors:
            stored = {}
        return {**stored, **self._used}

    async def _write(self, call) -> None:
        try:
            await call
        except self._errors as exc:
            raise APIError(503, f"the key store cannot be written ({exc}); nothing was "
                                "changed, retry when it answers", code="key_store_unavailable",
                           headers={"Retry-After": "1"}) from None
