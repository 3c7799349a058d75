"""The audit log: every admin action, who did it and to what, appended where the fleet can read
it: a capped Redis stream (`{prefix}audit`, the newest MAX_ENTRIES) with --redis-url, and always
this replica's own durable file (audit_file.py), so the trail never rests on Redis keeping its
data. Each entry has an id; Redis's copy is kept whole by `sync` (every heartbeat): when Redis
lost its data (the token at `{prefix}audit:token` is gone or new) or refused an append, this
replica puts back every entry of its file that the stream lacks, the stream rewritten in time
order under WATCH, so replicas doing it at once never duplicate an entry.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import msgspec
from redis.asyncio import Redis
from redis.exceptions import WatchError

from loragw.gateway.tenants.audit_file import AuditFile

logger = logging.getLogger(__name__)
MAX_ENTRIES = 100_000  # the stream's cap (approximate: XADD MAXLEN ~)
MAX_READ = 1_000  # GET /admin/audit?limit= at most
REPUBLISH_TRIES = 5  # WATCH races lost in one sync before waiting for the next heartbeat


class AuditEntry(msgspec.Struct, omit_defaults=False):
    time: float
    key_id: str  # the acting key ("operator", "api-key", "anonymous" for the static ones)
    tenant: str | None  # the acting key's tenant (None: the operator)
    action: str  # key.created | key.rotated | key.revoked | adapter.uploaded | ...
    adapter_id: str | None = None
    version: int | None = None
    sha256: str | None = None
    owner: str | None = None  # the tenant the adapter or key belongs to
    target_key_id: str | None = None  # the key a key.* action was on
    id: str = ""  # unique per entry ("" in entries written before ids): copies are one entry

    def visible_to(self, tenant: str | None) -> bool:
        return tenant is None or tenant in (self.tenant, self.owner)


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(AuditEntry).decode


def identity(entry: AuditEntry) -> str | bytes:
    return entry.id or _encode(entry)  # an entry from before ids: its whole text


class AuditLog:
    def __init__(self, folder: str, redis: Redis | None = None, prefix: str = "loragw:"):
        self.file = AuditFile(folder)
        self.folder, self.redis, self.stream = folder, redis, f"{prefix}audit"
        self.epoch_key = f"{prefix}audit:token"
        self._epoch: bytes | None = None  # Redis's token when it last held all of our file
        self._refused = 0  # appends Redis refused: one during a put-back keeps _epoch unknown
        self._lock = asyncio.Lock()

    async def append(self, entry: AuditEntry) -> None:
        raw = _encode(entry)
        try:
            async with self._lock:  # on disk first: the record outlives whatever Redis does
                await asyncio.to_thread(self.file.append, raw)
        except OSError as exc:
            if self.redis is None:
                raise
            logger.error("audit: cannot append to %s (%s); the entry is in Redis only",
                         self.file.path, exc)
        if self.redis is not None:
            try:
                await self.redis.xadd(self.stream, {"e": raw}, maxlen=MAX_ENTRIES,
                                      approximate=True)
            except Exception as exc:  # noqa: BLE001 (any Redis failure: the file has it)
                self._refused += 1
                self._epoch = None  # the next sync puts it in
                logger.warning("audit: Redis refused the entry (%s); kept in %s and published "
                               "when Redis answers", exc, self.file.path)

    async def sync(self) -> None:
        """Put back into Redis the entries of this replica's file it lacks, if Redis lost its
        data or refused an append since the last sync. Never raises."""
        if self.redis is None:
            return
        try:
            epoch = await self.redis.get(self.epoch_key)
            if epoch is None or epoch != self._epoch:
                await self._republish()
        except Exception as exc:  # noqa: BLE001 (Redis away: the next heartbeat tries again)
            logger.debug("audit: cannot publish the local trail yet: %s", exc)

    async def _republish(self) -> None:
        refused = self._refused
        local = {identity(e): e for e in self._decode_lines(
            await asyncio.to_thread(self.file.lines))}
        for _ in range(REPUBLISH_TRIES):
            async with self.redis.pipeline(transaction=True) as pipe:
                await pipe.watch(self.stream, self.epoch_key)
                epoch = await pipe.get(self.epoch_key) or uuid.uuid4().hex.encode()
                held = {identity(e): e for e in self._decode_lines(
                    fields[b"e"] for _, fields in await pipe.xrange(self.stream))} \
                    if local else {}
                missing = [e for k, e in local.items() if k not in held]
                pipe.multi()
                if missing:  # rewritten in time order: a read by newest stays by time
                    pipe.delete(self.stream)
                    for entry in sorted([*held.values(), *missing], key=lambda e: e.time):
                        pipe.xadd(self.stream, {"e": _encode(entry)}, maxlen=MAX_ENTRIES,
                                  approximate=True)
                pipe.set(self.epoch_key, epoch)
                try:
                    await pipe.execute()
                except WatchError:
                    continue  # another replica wrote meanwhile: read again
            if missing:
                logger.info("audit: put %d entr(ies) Redis lacked back from %s", len(missing),
                            self.file.path)
            if refused == self._refused:  # else one came after our read of the file
                self._epoch = epoch
            return

    async def read(self, limit: int, tenant: str | None) -> list[AuditEntry]:
        """The newest `limit` entries `tenant` may see (None: all), newest first."""
        entries = await self._read_redis(limit, tenant) if self.redis is not None else []
        if len(entries) < limit:  # this replica's file: no Redis, or entries not yet put back
            local = [e for e in self._decode_lines(await asyncio.to_thread(self.file.lines))
                     if e.visible_to(tenant)]
            merged = {identity(e): e for e in local} | {identity(e): e for e in entries}
            entries = sorted(merged.values(), key=lambda e: -e.time)
        return entries[:limit]

    async def _read_redis(self, limit: int, tenant: str | None) -> list[AuditEntry]:
        out: list[AuditEntry] = []
        last = "+"
        try:
            while len(out) < limit:
                batch = await self.redis.xrevrange(self.stream, max=last, count=max(limit, 100))
                if last != "+":
                    batch = batch[1:]  # the entry `last` itself, read again
                if not batch:
                    break
                for _, fields in batch:
                    entry = _decode(fields[b"e"])
                    if entry.visible_to(tenant):
                        out.append(entry)
                last = batch[-1][0]
        except Exception as exc:  # noqa: BLE001
            logger.warning("audit: cannot read Redis (%s); showing this replica's file", exc)
        return out

    @staticmethod
    def _decode_lines(lines) -> list[AuditEntry]:
        out = []
        for line in lines:
            try:
                out.append(_decode(line))
            except msgspec.DecodeError:
                continue  # a torn last line after a crash
        return out[-MAX_ENTRIES:]


def now_entry(principal, action: str, **fields) -> AuditEntry:
    return AuditEntry(time.time(), principal.key_id, principal.tenant, action, **fields,
                      id=uuid.uuid4().hex)
