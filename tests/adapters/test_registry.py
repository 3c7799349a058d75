"""The residency registry, in-process and over a real redis-server on loopback.

Replicas here are RedisRegistry clients in one event loop with a short heartbeat, so expiry,
outages and restarts play out in a few seconds each. No assertion rests on a window narrower
than SLACK_S, the scheduling delay allowed on a loaded 2-core machine: what must happen is
waited for (`eventually`) up to a deadline that long past its due time, and what must not happen
yet is checked at least that long before it may.
"""

import asyncio
import inspect
import time

import pytest
from redis_server import RedisServer, redis_server  # noqa: F401  (fixture)

from loragw.adapters.registry import (
    EVENT_ADDED,
    EVENT_DELETED,
    EVENT_REPLACED,
    AdapterEvent,
    CatalogEntry,
    InProcessRegistry,
    Registry,
    ReplicaState,
    make_registry,
)
from loragw.adapters.registry_redis import RedisRegistry

HEARTBEAT_S = 0.2
TTL_S = 3.0  # fifteen heartbeats: a stall of the event loop shorter than that expires no one
SLACK_S = 1.0  # several times the scheduling noise of a busy 2-core machine
# What "within one heartbeat" allows: a heartbeat and slack, still short of a TTL (so a fleet
# that comes back on its heartbeat is told apart from one waiting for states to expire).
WITHIN_A_HEARTBEAT_S = HEARTBEAT_S + SLACK_S
assert WITHIN_A_HEARTBEAT_S + SLACK_S < TTL_S


def entry(adapter_id: str, sha: str = "a", version: int = 1) -> CatalogEntry:
    return CatalogEntry(
        adapter_id=adapter_id,
        source=f"hf://org/{adapter_id}",
        revision=None,
        sha256=sha * 64,
        rank=8,
        targets=("q_proj", "v_proj"),
        num_bytes=1 << 20,
        version=version,
    )


def state(replica_id: str, *resident: str, free_slots: int = 2) -> ReplicaState:
    return ReplicaState(
        replica_id=replica_id,
        url=f"http://{replica_id}:8000",
        resident=resident,
        loading=(),
        free_slots=free_slots,
        queue_depth=0,
        updated_at=0.0,
    )


async def eventually(check, timeout: float = 10.0):
    """Poll ``check()`` (sync or async) until it is truthy; returns the value, fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout} s (last value {value!r})")
        await asyncio.sleep(0.01)


@pytest.fixture
async def replicas(redis_server: RedisServer):  # noqa: F811
    """Start RedisRegistry replicas on the test's Redis; all closed at the end."""
    started: list[RedisRegistry] = []

    async def start(replica_id: str) -> RedisRegistry:
        reg = RedisRegistry(redis_server.url, replica_id, heartbeat_s=HEARTBEAT_S, ttl_s=TTL_S)
        await reg.start()
        started.append(reg)
        return reg

    yield start
    for reg in started:
        await reg.close()


def recorder(registry) -> list[AdapterEvent]:
    seen: list[AdapterEvent] = []

    async def on_event(event: AdapterEvent) -> None:
        seen.append(event)

    registry.subscribe(on_event)
    return seen


def ids(states: list[ReplicaState]) -> list[str]:
    return [s.replica_id for s in states]


# -- two replicas over Redis ---------------------------------------------------------------------


async def test_two_replicas_see_each_others_residency(replicas):
    a, b = await replicas("a"), await replicas("b")
    assert a.healthy and b.healthy and isinstance(a, Registry)
    await a.publish_state(state("a", "sql-lora"))
    await b.publish_state(state("b", "chat-lora", free_slots=0))
    for reg in (a, b):
        seen = {s.replica_id: s for s in await reg.replicas()}
        assert seen["a"].resident == ("sql-lora",) and seen["a"].url == "http://a:8000"
        assert seen["b"].resident == ("chat-lora",) and seen["b"].free_slots == 0
        assert seen["a"].updated_at > 0
    await a.publish_state(state("a", "sql-lora", "math-lora"))
    assert {s.replica_id: s.resident for s in await b.replicas()}["a"] == ("sql-lora", "math-lora")


async def test_catalog_is_shared(replicas):
    a, b = await replicas("a"), await replicas("b")
    await a.put_adapter(entry("sql-lora"))
    await b.put_adapter(entry("org/chat", sha="b"))
    assert await b.get_adapter("sql-lora") == entry("sql-lora")
    assert await a.get_adapter("org/chat") == entry("org/chat", sha="b")
    assert await a.get_adapter("nope") is None
    assert [e.adapter_id for e in await a.list_adapters()] == ["org/chat", "sql-lora"]
    assert await b.delete_adapter("sql-lora") is True
    assert await b.delete_adapter("sql-lora") is False
    assert await a.get_adapter("sql-lora") is None
    assert await a.list_adapters() == [entry("org/chat", sha="b")]


async def test_delete_and_replace_are_announced_to_every_replica(replicas):
    a, b = await replicas("a"), await replicas("b")
    seen_a, seen_b = recorder(a), recorder(b)
    await a.put_adapter(entry("sql-lora"))
    await a.put_adapter(entry("sql-lora"))  # same weights: nothing to announce
    await b.put_adapter(entry("sql-lora", sha="c", version=2))
    await a.delete_adapter("sql-lora")
    expected = [
        AdapterEvent(EVENT_ADDED, "sql-lora", 1, origin="a"),
        AdapterEvent(EVENT_REPLACED, "sql-lora", 2, origin="b"),
        AdapterEvent(EVENT_DELETED, "sql-lora", 2, origin="a"),
    ]
    await eventually(lambda: len(seen_a) >= 3 and len(seen_b) >= 3)
    assert seen_a == expected and seen_b == expected  # own events come back too


async def test_a_delete_on_one_replica_evicts_the_adapter_on_the_other(replicas):
    a, b = await replicas("a"), await replicas("b")
    resident_b = {"sql-lora", "chat-lora"}

    async def drop_stale(event: AdapterEvent) -> None:  # what b's residency manager does
        resident_b.discard(event.adapter_id)
        await b.publish_state(state("b", *sorted(resident_b)))

    b.subscribe(drop_stale)
    await a.put_adapter(entry("sql-lora"))
    await b.publish_state(state("b", *sorted(resident_b)))
    await a.delete_adapter("sql-lora")

    async def b_dropped_it():
        return {s.replica_id: s.resident for s in await a.replicas()}["b"] == ("chat-lora",)

    await eventually(b_dropped_it)


async def test_a_replica_that_stops_heartbeating_expires(replicas):
    a, b, c = await replicas("a"), await replicas("b"), await replicas("c")
    for reg in (a, b, c):
        await reg.publish_state(state(reg.replica_id))
    await c.close()  # graceful: gone at once
    assert ids(await a.replicas()) == ["a", "b"]
    last_write = time.monotonic()  # b's state expires TTL_S after this write, not sooner
    await b.publish_state(state("b"))
    await b.close(deregister=False)  # a crash: no goodbye, only the heartbeat stops
    await asyncio.sleep(2 * HEARTBEAT_S)  # heartbeats b would have sent, had it not crashed
    listed, checked_at = ids(await a.replicas()), time.monotonic() - last_write
    assert checked_at < TTL_S - SLACK_S, f"the event loop stalled {checked_at:.1f} s"
    assert listed == ["a", "b"]  # still listed until its ttl runs out
    await eventually(lambda: _ids_are(a, ["a"]), timeout=TTL_S + SLACK_S)
    assert time.monotonic() - last_write >= TTL_S - 0.05
    await asyncio.sleep(TTL_S)  # and a live one, heartbeating, never expires
    assert ids(await a.replicas()) == ["a"]


async def _ids_are(reg, expected: list[str]) -> bool:
    return ids(await reg.replicas()) == expected


async def test_redis_down_calls_keep_serving_from_what_is_known(replicas, redis_server):  # noqa: F811
    a, b = await replicas("a"), await replicas("b")
    await a.put_adapter(entry("sql-lora"))
    await a.publish_state(state("a", "sql-lora"))
    await b.publish_state(state("b"))
    assert await b.get_adapter("sql-lora") is not None
    await b.list_adapters()
    redis_server.kill()

    await eventually(lambda: not a.healthy and not b.healthy)
    started = time.monotonic()
    assert await b.get_adapter("sql-lora") == entry("sql-lora")  # cached
    assert await b.list_adapters() == [entry("sql-lora")]
    assert ids(await b.replicas()) == ["b"]  # alone: the router serves locally
    await b.put_adapter(entry("new-lora"))  # remembered, replayed later
    assert await b.get_adapter("new-lora") == entry("new-lora")
    assert await a.delete_adapter("sql-lora") is True
    assert await a.get_adapter("sql-lora") is None
    await a.publish_state(state("a"))
    assert time.monotonic() - started < 0.5, "calls must not wait on a dead Redis"
    await asyncio.sleep(3 * HEARTBEAT_S)  # heartbeats and reconnect attempts fail quietly
    assert not a.healthy and not b.healthy


async def test_redis_restarted_empty_between_heartbeats(replicas, redis_server):  # noqa: F811
    a, b = await replicas("a"), await replicas("b")
    seen_b = recorder(b)
    await a.put_adapter(entry("sql-lora"))
    await b.put_adapter(entry("chat-lora", sha="b"))
    await a.publish_state(state("a", "sql-lora"))
    await b.publish_state(state("b", "chat-lora"))

    redis_server.restart()  # blocks the loop: the replicas see no error, only an empty Redis
    restarted_at = time.monotonic()
    await eventually(lambda: _fleet_is_back(a, b), timeout=WITHIN_A_HEARTBEAT_S)
    assert time.monotonic() - restarted_at < WITHIN_A_HEARTBEAT_S
    await _pubsub_works(a, seen_b)


async def test_redis_killed_then_restarted_empty_replays_writes(replicas, redis_server):  # noqa: F811
    a, b = await replicas("a"), await replicas("b")
    seen_b = recorder(b)
    await a.put_adapter(entry("sql-lora"))
    await a.put_adapter(entry("old-lora"))
    await b.put_adapter(entry("chat-lora", sha="b"))
    await a.publish_state(state("a"))
    await b.publish_state(state("b", "chat-lora"))
    redis_server.kill()
    await eventually(lambda: not a.healthy and not b.healthy)
    await a.delete_adapter("old-lora")  # made while away: must not come back
    await a.publish_state(state("a", "sql-lora"))  # the latest state is the one re-registered

    redis_server.restart()
    restarted_at = time.monotonic()
    await eventually(lambda: _fleet_is_back(a, b), timeout=WITHIN_A_HEARTBEAT_S)
    assert time.monotonic() - restarted_at < WITHIN_A_HEARTBEAT_S
    assert a.healthy and b.healthy
    assert await b.get_adapter("old-lora") is None
    await _pubsub_works(a, seen_b)


async def _fleet_is_back(a, b) -> bool:
    residency = {s.replica_id: s.resident for s in await b.replicas()}
    catalog = {e.adapter_id for e in await a.list_adapters()}
    return residency == {"a": ("sql-lora",), "b": ("chat-lora",)} and catalog >= {
        "sql-lora",
        "chat-lora",
    }


async def _pubsub_works(a, seen_b: list[AdapterEvent]) -> None:
    before = len(seen_b)
    await a.delete_adapter("sql-lora")
    await eventually(lambda: len(seen_b) > before)
    assert seen_b[-1] == AdapterEvent(EVENT_DELETED, "sql-lora", 1, origin="a")


async def test_a_replica_started_while_redis_is_down_joins_when_it_comes_up(
    replicas,
    redis_server,  # noqa: F811
):
    redis_server.kill()
    a = await replicas("a")  # does not raise
    assert not a.healthy
    await a.put_adapter(entry("sql-lora"))
    await a.publish_state(state("a", "sql-lora"))
    assert await a.list_adapters() == [entry("sql-lora")]
    redis_server.restart()
    b = await replicas("b")
    await b.publish_state(state("b"))
    await eventually(lambda: _ids_are(b, ["a", "b"]), timeout=WITHIN_A_HEARTBEAT_S)
    assert await b.get_adapter("sql-lora") == entry("sql-lora")


class Partition:
    """A TCP proxy in front of Redis that a test can cut: Redis keeps its data, a replica loses it."""

    def __init__(self, redis_port: int) -> None:
        self.redis_port = redis_port
        self.cut_off = False
        self._pipes: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.redis_port)
        self._pipes |= {writer, up_writer}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                dst.write(data)
            dst.close()

        await asyncio.gather(
            pump(reader, up_writer), pump(up_reader, writer), return_exceptions=True
        )

    def cut(self) -> None:
        self.cut_off = True
        for writer in self._pipes:
            writer.close()
        self._pipes.clear()

    async def close(self) -> None:
        self.cut()
        self._server.close()


async def test_changes_missed_during_a_partition_are_announced_on_return(
    replicas,
    redis_server,  # noqa: F811
):
    partition = Partition(redis_server.port)
    a = await replicas("a")
    b = RedisRegistry(await partition.start(), "b", heartbeat_s=HEARTBEAT_S, ttl_s=TTL_S)
    await b.start()
    seen_b = recorder(b)
    await a.put_adapter(entry("sql-lora"))
    await a.put_adapter(entry("chat-lora"))
    await b.put_adapter(entry("b-lora", sha="b"))
    assert len(await b.list_adapters()) == 3
    await eventually(lambda: len(seen_b) == 3)  # the three "added"
    before = len(seen_b)

    partition.cut()
    await eventually(lambda: not b.healthy)
    await a.delete_adapter("sql-lora")  # b is not listening
    await a.put_adapter(entry("chat-lora", sha="d", version=2))
    assert await b.get_adapter("sql-lora") == entry("sql-lora")  # stale, but all b knows
    partition.cut_off = False  # heal

    await eventually(lambda: b.healthy)
    assert sorted(seen_b[before:], key=lambda e: e.kind) == [
        AdapterEvent(EVENT_DELETED, "sql-lora", 1, origin=""),
        AdapterEvent(EVENT_REPLACED, "chat-lora", 2, origin=""),
    ]
    assert await b.get_adapter("sql-lora") is None
    assert [e.adapter_id for e in await a.list_adapters()] == ["b-lora", "chat-lora"]
    await b.close()
    await partition.close()


def test_ttl_must_exceed_heartbeat():
    with pytest.raises(ValueError, match="ttl_s=1.0 must exceed heartbeat_s=2.0"):
        RedisRegistry("redis://127.0.0.1:1/0", "a", heartbeat_s=2.0, ttl_s=1.0)


# -- in-process --------------------------------------------------------------------------------


async def test_in_process_registry_follows_the_interface():
    reg = make_registry(None, "solo")
    assert isinstance(reg, InProcessRegistry) and isinstance(reg, Registry) and reg.healthy
    await reg.start()
    events = recorder(reg)
    sync_events: list[AdapterEvent] = []
    reg.subscribe(sync_events.append)  # plain functions work as subscribers too

    await reg.put_adapter(entry("sql-lora"))
    await reg.put_adapter(entry("org/chat", sha="b"))
    assert await reg.get_adapter("sql-lora") == entry("sql-lora")
    assert [e.adapter_id for e in await reg.list_adapters()] == ["org/chat", "sql-lora"]
    await reg.put_adapter(entry("sql-lora"))  # same weights: silent
    await reg.put_adapter(entry("sql-lora", sha="c", version=2))
    assert await reg.delete_adapter("sql-lora") is True
    assert await reg.delete_adapter("sql-lora") is False
    assert (
        events
        == sync_events
        == [
            AdapterEvent(EVENT_ADDED, "sql-lora", 1, origin="solo"),
            AdapterEvent(EVENT_ADDED, "org/chat", 1, origin="solo"),
            AdapterEvent(EVENT_REPLACED, "sql-lora", 2, origin="solo"),
            AdapterEvent(EVENT_DELETED, "sql-lora", 2, origin="solo"),
        ]
    )
    assert await reg.replicas() == []
    await reg.publish_state(state("solo", "org/chat"))
    (only,) = await reg.replicas()
    assert only.resident == ("org/chat",) and only.updated_at > 0
    await reg.close()


async def test_a_failing_subscriber_does_not_stop_the_others():
    reg = InProcessRegistry("solo")

    def broken(event: AdapterEvent) -> None:
        raise RuntimeError("boom")

    reg.subscribe(broken)
    events = recorder(reg)
    await reg.put_adapter(entry("x"))
    await reg.delete_adapter("x")
    assert [e.kind for e in events] == [EVENT_ADDED, EVENT_DELETED]


def test_make_registry_picks_redis_when_a_url_is_given():
    reg = make_registry("redis://127.0.0.1:1/0", "r1", heartbeat_s=0.5, ttl_s=1.5)
    assert isinstance(reg, RedisRegistry) and reg.replica_id == "r1" and not reg.healthy
