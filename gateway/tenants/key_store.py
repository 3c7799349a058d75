"""Where tenant keys are kept: Redis, shared by the fleet (`RedisKeyStore`), or a file beside
the adapter store on a single replica (`FileKeyStore`). Both hold `KeyRecord`s (hashes, never
secrets) and the time each key was last used; the keyring (keyring.py) mirrors them in memory.

Redis keys, under the registry's prefix:
    tenant:keys      hash   key id -> KeyRecord JSON
    tenant:hashes    hash   sha256 of a secret -> key id (current and in-grace secrets)
    tenant:used      hash   key id -> unix time of its last use (flushed every heartbeat)
    tenant:version   string bumped by every change: a replica re-reads the keys when it moves;
                            missing while a replica knows keys means Redis lost its data, and
                            that replica writes back what it knows
A change is one MULTI/EXEC: record, hashes and version together. Calls raise what Redis
raises; the keyring decides what an outage means.
"""

from __future__ import annotations

import asyncio
import json
import os

import msgspec
from redis.asyncio import Redis

from loragw.adapters.durable_fs import fsync_dir
from loragw.gateway.tenants.keys import KeyRecord

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(KeyRecord).decode


class RedisKeyStore:
    def __init__(self, redis: Redis, prefix: str):
        self.redis = redis
        self.keys_key, self.hashes_key = f"{prefix}tenant:keys", f"{prefix}tenant:hashes"
        self.used_key, self.version_key = f"{prefix}tenant:used", f"{prefix}tenant:version"

    async def version(self) -> str | None:
        raw = await self.redis.get(self.version_key)
        return raw.decode() if raw is not None else None

    async def load(self) -> tuple[dict[str, KeyRecord], str | None]:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(self.keys_key)
            pipe.get(self.version_key)
            raw, version = await pipe.execute()
        records = {}
        for value in raw.values():
            try:
                record = _decode(value)
            except msgspec.DecodeError:
                continue  # written by an incompatible version: not a key we can honour
            records[record.id] = record
        return records, version.decode() if version is not None else None

    async def put(self, record: KeyRecord, dropped: tuple[str, ...] = ()) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys_key, record.id, _encode(record))
            for digest in dropped:
                pipe.hdel(self.hashes_key, digest)
            for digest in {record.hash, record.old_hash} - {""}:
                pipe.hset(self.hashes_key, digest, record.id)
            pipe.incr(self.version_key)
            await pipe.execute()

    async def delete(self, record: KeyRecord) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self.keys_key, record.id)
            pipe.hdel(self.used_key, record.id)
            for digest in {record.hash, record.old_hash} - {""}:
                pipe.hdel(self.hashes_key, digest)
            pipe.incr(self.version_key)
            await pipe.execute()

    async def lookup(self, digest: str) -> KeyRecord | None:
        """The record a secret's digest opens (a key minted on another replica moments ago)."""
        key_id = await self.redis.hget(self.hashes_key, digest)
        raw = await self.redis.hget(self.keys_key, key_id) if key_id is not None else None
        return _decode(raw) if raw is not None else None

    async def get(self, key_id: str) -> KeyRecord | None:
        raw = await self.redis.hget(self.keys_key, key_id)
        return _decode(raw) if raw is not None else None

    async def restore(self, records: dict[str, KeyRecord]) -> None:
        """Write back what a replica knows after Redis lost its data, unless someone did."""
        async with self.redis.pipeline(transaction=True) as pipe:
            for record in records.values():
                pipe.hsetnx(self.keys_key, record.id, _encode(record))
                pipe.hsetnx(self.hashes_key, record.hash, record.id)
            pipe.incr(self.version_key)
            await pipe.execute()

    async def touch(self, used: dict[str, float]) -> None:
        if used:
            await self.redis.hset(self.used_key, mapping={k: repr(v) for k, v in used.items()})

    async def last_used(self) -> dict[str, float]:
        return {k.decode(): float(v) for k, v in (await self.redis.hgetall(self.used_key)).items()}


class FileKeyStore:
    """`<adapter dir>/.tenants/keys.json`, replaced atomically (written, fsynced, renamed) on
    every change (on a worker thread); this replica's keyring is its only writer."""

    def __init__(self, folder: str):
        self.folder, self.path = folder, os.path.join(folder, "keys.json")
        self._records: dict[str, KeyRecord] = {}
        self._used: dict[str, float] = {}
        self._version = 0
        self._lock = asyncio.Lock()
        self._read()

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                data = json.load(f)
        except FileNotFoundError:
            return
        self._records = {r["id"]: msgspec.convert(r, KeyRecord) for r in data["keys"]}
        self._used = {k: float(v) for k, v in data.get("used", {}).items()}
        self._version = int(data.get("version", 0))

    def _write(self) -> None:
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        data = {"version": self._version, "keys": msgspec.to_builtins(list(self._records.values())),
                "used": self._used}
        tmp = self.path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.folder)

    async def version(self) -> str | None:
        return str(self._version)

    async def load(self) -> tuple[dict[str, KeyRecord], str | None]:
        return dict(self._records), str(self._version)

    async def put(self, record: KeyRecord, dropped: tuple[str, ...] = ()) -> None:
        async with self._lock:
            self._records[record.id] = record
            self._version += 1
            await asyncio.to_thread(self._write)

    async def delete(self, record: KeyRecord) -> None:
        async with self._lock:
            self._records.pop(record.id, None)
            self._used.pop(record.id, None)
            self._version += 1
            await asyncio.to_thread(self._write)

    async def lookup(self, digest: str) -> KeyRecord | None:
        return None  # the keyring already mirrors this file whole

    async def get(self, key_id: str) -> KeyRecord | None:
        return None

    async def restore(self, records: dict[str, KeyRecord]) -> None:
        pass

    async def touch(self, used: dict[str, float]) -> None:
        if used:
            async with self._lock:
                self._used.update(used)
                await asyncio.to_thread(self._write)

    async def last_used(self) -> dict[str, float]:
        return dict(self._used)
