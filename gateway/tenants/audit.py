"""The audit log: every admin action, who did it and to what, appended where the fleet can read
it: a capped Redis stream (`{prefix}audit`, the newest MAX_ENTRIES) with --redis-url, else
`<adapter dir>/.tenants/audit.jsonl`. An append Redis refuses goes to the file instead (and a
warning to the log): an action is never left unrecorded because Redis blinked.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import msgspec
from redis.asyncio import Redis

logger = logging.getLogger(__name__)
MAX_ENTRIES = 100_000  # the stream's cap (approximate: XADD MAXLEN ~)
MAX_READ = 1_000  # GET /admin/audit?limit= at most


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

    def visible_to(self, tenant: str | None) -> bool:
        return tenant is None or tenant in (self.tenant, self.owner)


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(AuditEntry).decode


class AuditLog:
    def __init__(self, folder: str, redis: Redis | None = None, prefix: str = "loragw:"):
        self.path = os.path.join(folder, "audit.jsonl")
        self.folder, self.redis, self.stream = folder, redis, f"{prefix}audit"
        self._lock = asyncio.Lock()

    async def append(self, entry: AuditEntry) -> None:
        raw = _encode(entry)
        if self.redis is not None:
            try:
                await self.redis.xadd(self.stream, {"e": raw}, maxlen=MAX_ENTRIES,
                                      approximate=True)
                return
            except Exception as exc:  # noqa: BLE001 (any Redis failure: keep the record)
                logger.warning("audit: Redis refused the entry (%s); appended to %s", exc,
                               self.path)
        async with self._lock:
            await asyncio.to_thread(self._append_file, raw)

    def _append_file(self, raw: bytes) -> None:
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, raw + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)

    async def read(self, limit: int, tenant: str | None) -> list[AuditEntry]:
        """The newest `limit` entries `tenant` may see (None: all), newest first."""
        entries = await self._read_redis(limit, tenant) if self.redis is not None else []
        if len(entries) < limit:  # the file: no Redis, or entries Redis refused
            local = [e for e in await asyncio.to_thread(self._read_file) if e.visible_to(tenant)]
            entries = sorted(entries + local, key=lambda e: -e.time)
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

    def _read_file(self) -> list[AuditEntry]:
        try:
            with open(self.path, "rb") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines[-MAX_ENTRIES:]:
            try:
                out.append(_decode(line))
            except msgspec.DecodeError:
                continue  # a torn last line after a crash
        return out


def now_entry(principal, action: str, **fields) -> AuditEntry:
    return AuditEntry(time.time(), principal.key_id, principal.tenant, action, **fields)
