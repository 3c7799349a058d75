"""Where the registry keeps its data in Redis, and the reads and writes of it.

Keys, under ``prefix`` (the gateway's: ``loragw:<base key>:``, one catalog per base model,
adapters.base_identity):
    catalog          hash   adapter_id -> CatalogEntry JSON
    replica:{id}     string ReplicaState JSON (the adapters it holds: in slots, in host memory
                            or on disk), expiring ttl_s after the last heartbeat
    replicas         set    replica ids, pruned of expired ones whenever it is read
    epoch            string a random token, set by the first replica to find it missing: a new
                            token means Redis lost its data, so every replica restores its writes
    events           pub/sub channel of AdapterEvent JSON ("added" | "deleted" | "replaced")

Catalog writes are Lua scripts that compare, write and publish in one step. Every call here is
one round trip and raises what Redis raises; staying up while Redis is away is RedisRegistry's
job (adapters.registry_redis).
"""

from __future__ import annotations

import uuid

from redis.asyncio import Redis

from loragw.adapters.registry_types import (
    CatalogEntry,
    ReplicaState,
    decode_all,
    decode_entry,
    decode_state,
    encode,
)

# KEYS: catalog, events   ARGV: adapter_id, entry JSON, origin
_PUT = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local n = cjson.decode(ARGV[2])
local kind = 'added'
if old then
  local o = cjson.decode(old)
  if o.sha256 == n.sha256 and o.version == n.version then return 0 end
  kind = 'replaced'
end
redis.call('PUBLISH', KEYS[2], cjson.encode({kind=kind, adapter_id=ARGV[1],
                                             version=n.version, origin=ARGV[3]}))
return 1
"""
# KEYS: catalog, events   ARGV: adapter_id, origin
_DELETE = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if not old then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('PUBLISH', KEYS[2], cjson.encode({kind='deleted', adapter_id=ARGV[1],
                                             version=cjson.decode(old).version, origin=ARGV[2]}))
return 1
"""
# KEYS: replica index   ARGV: state key prefix.  Returns live states; drops expired ids.
_LIVE_REPLICAS = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local v = redis.call('GET', ARGV[1] .. id)
  if v then out[#out + 1] = v else redis.call('SREM', KEYS[1], id) end
end
return out
"""


class RedisLayout:
    """The registry's keys under one prefix, read and written through ``redis``."""

    def __init__(self, redis: Redis, prefix: str) -> None:
        self._redis = redis
        self.catalog_key, self.index_key = f"{prefix}catalog", f"{prefix}replicas"
        self.state_key_prefix, self.epoch_key = f"{prefix}replica:", f"{prefix}epoch"
        self.events_channel = f"{prefix}events"
        self._put_script = redis.register_script(_PUT)
        self._delete_script = redis.register_script(_DELETE)
        self._live_script = redis.register_script(_LIVE_REPLICAS)

    # -- catalog ----------------------------------------------------------------------------

    async def write_entry(self, adapter_id: str, entry: CatalogEntry | None, origin: str) -> bool:
        """Write one catalog change (None = delete) with its announcement, atomically.
        False only for a delete of an id the catalog did not hold."""
        keys = [self.catalog_key, self.events_channel]
        if entry is None:
            return bool(await self._delete_script(keys=keys, args=[adapter_id, origin]))
        await self._put_script(keys=keys, args=[adapter_id, encode(entry), origin])
        return True

    async def read_entry(self, adapter_id: str) -> tuple[CatalogEntry | None, bytes | None]:
        """One entry (None: not in the catalog) and the epoch token, read together: an
        absence means "deleted" only under the epoch the reader knows."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hget(self.catalog_key, adapter_id)
            pipe.get(self.epoch_key)
            raw, epoch = await pipe.execute()
        found = decode_all(decode_entry, [raw] if raw else [])
        return (found[0] if found else None), epoch

    async def read_catalog(self) -> tuple[dict[str, CatalogEntry], bytes | None]:
        """The whole catalog and the epoch token, read together."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(self.catalog_key)
            pipe.get(self.epoch_key)
            raw, epoch = await pipe.execute()
        return {e.adapter_id: e for e in decode_all(decode_entry, raw.values())}, epoch

    async def restore_entries(self, entries: dict[str, CatalogEntry]) -> None:
        """Put entries back after Redis lost its data, unless someone already did."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for adapter_id, entry in entries.items():
                pipe.hsetnx(self.catalog_key, adapter_id, encode(entry))
            await pipe.execute()

    # -- replicas and epoch -----------------------------------------------------------------

    async def live_replicas(self) -> list[ReplicaState]:
        raw = await self._live_script(keys=[self.index_key], args=[self.state_key_prefix])
        return sorted(decode_all(decode_state, raw), key=lambda s: s.replica_id)

    async def write_state(self, state: ReplicaState, ttl_ms: int) -> bytes | None:
        """Store state expiring in ttl_ms and index its replica; returns the epoch token seen."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self.state_key_prefix + state.replica_id, encode(state), px=ttl_ms)
            pipe.sadd(self.index_key, state.replica_id)
            pipe.get(self.epoch_key)
            *_, epoch = await pipe.execute()
        return epoch

    async def remove_state(self, replica_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.state_key_prefix + replica_id)
            pipe.srem(self.index_key, replica_id)
            await pipe.execute()

    async def read_epoch(self) -> bytes | None:
        return await self._redis.get(self.epoch_key)

    async def claim_epoch(self) -> bytes:
        """The epoch token, set to a fresh one first if Redis has none (it lost its data)."""
        await self._redis.set(self.epoch_key, uuid.uuid4().hex, nx=True)
        return await self._redis.get(self.epoch_key)
