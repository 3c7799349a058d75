"""The audit trail and the aliases outlive a Redis that loses its data (gateway/tenants/audit.py,
audit_file.py, adapters/alias_store.py), on a real redis-server: two AuditLogs or AliasBooks
are two replicas; FLUSHALL is Redis coming back empty.
"""

from __future__ import annotations

import json

import pytest
import redis.asyncio
from fleet_harness import load_fixture_module

from loragw.adapters.alias_store import AliasBook
from loragw.adapters.aliases import Alias, AliasTarget
from loragw.gateway.tenants.audit import AuditLog, now_entry
from loragw.gateway.tenants.audit_file import AuditFile

redis_fixture = load_fixture_module("redis_server")
redis_server = redis_fixture.redis_server  # the fixture: a running, empty redis-server


class Caller:
    """The two fields an entry takes from the acting key."""

    def __init__(self, key_id: str, tenant: str | None):
        self.key_id, self.tenant = key_id, tenant


@pytest.fixture
async def store(redis_server):
    client = redis.asyncio.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


def test_the_file_rotates_and_keeps_two_generations(tmp_path):
    trail = AuditFile(str(tmp_path), max_bytes=1000)
    lines = [json.dumps({"n": i, "pad": "x" * 80}).encode() for i in range(45)]
    for line in lines:
        trail.append(line)
    kept = trail.lines()
    assert kept == lines[-len(kept):]  # the newest, in order
    assert 10 <= len(kept) < 45  # bounded: about two files' worth
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.1.jsonl", "audit.jsonl"]


async def test_every_entry_is_listed_once_after_redis_comes_back_empty(redis_server, store,
                                                                       tmp_path):
    logs = [AuditLog(str(tmp_path / rid), redis.asyncio.Redis.from_url(redis_server.url))
            for rid in ("r1", "r2")]
    for log in logs:
        await log.sync()
    made = []
    for i in range(6):
        entry = now_entry(Caller(f"key_{i}", "acme"), "key.created", owner="acme")
        await logs[i % 2].append(entry)
        made.append(entry)
    await store.flushall()  # Redis restarted empty
    assert await logs[0].read(100, None) != made[::-1]  # r1's file alone holds half
    for log in logs:
        await log.sync()
        await log.sync()  # a second sync changes nothing
    assert await store.xlen("loragw:audit") == len(made)
    for log in logs:
        assert await log.read(100, None) == made[::-1]  # newest first, each once
        assert await log.read(2, "acme") == made[::-1][:2]
    for log in logs:
        await log.redis.aclose()


async def test_an_entry_redis_refused_is_published_when_it_answers(redis_server, tmp_path):
    log = AuditLog(str(tmp_path), redis.asyncio.Redis.from_url(redis_server.url))
    await log.sync()
    redis_server.kill()
    entry = now_entry(Caller("operator", None), "adapter.deleted", adapter_id="bot")
    await log.append(entry)  # on disk; Redis refused it
    assert await log.read(10, None) == [entry]
    redis_server.start()
    await log.sync()
    reader = AuditLog(str(tmp_path / "other"), redis.asyncio.Redis.from_url(redis_server.url))
    assert await reader.read(10, None) == [entry]  # another replica sees it through Redis
    for one in (log, reader):
        await one.redis.aclose()


async def test_aliases_are_written_back_after_redis_comes_back_empty(redis_server, store):
    books = [AliasBook.open(redis_server.url) for _ in range(2)]
    live = Alias("live", (AliasTarget("bot@2", 90), AliasTarget("bot@3", 10)), "", 1)
    await books[0].put(live)
    await books[1].sync()
    await books[1].put(Alias("gone", (AliasTarget("bot", 1),), "", 1))
    assert await books[0].delete("gone")
    await books[1].sync()
    assert books[1].get("live") == live and books[1].get("gone") is None
    await store.flushall()  # Redis restarted empty
    await books[1].sync()
    await books[0].sync()
    for book in books:
        assert [a.alias for a in book.all()] == ["live"] and book.get("live") == live
    assert await store.hkeys("loragw:aliases") == [b"live"]
    for book in books:
        await book.close()
