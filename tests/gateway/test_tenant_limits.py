"""Per-key limits (gateway/tenants/limits.py) over a real redis-server on loopback.

Two Limiters on two Redis clients are two replicas; 64 callers at once must get exactly the
limit between them. Each test that runs with ("redis") also runs on the in-process fallback alone
("local"), which must apply the same limits the same way. No assertion rests on a margin under
0.4 s of scheduling noise.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis.asyncio
from fleet_harness import load_fixture_module
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from loragw.gateway.tenants import limits as limits_module
from loragw.gateway.tenants.limits import Limiter
from loragw.gateway.tenants.windows import Decision, Limits, format_reset, rate_limit_headers

redis_fixture = load_fixture_module("redis_server")
redis_server = redis_fixture.redis_server  # the fixture: a running, empty redis-server
CALLERS = 64
PREFIX = "loragw:"


def client(url: str) -> redis.asyncio.Redis:
    # No retries: a killed server fails at once, as the fallback test needs.
    return redis.asyncio.Redis.from_url(url, socket_timeout=1.0, retry=Retry(NoBackoff(), 0))


@pytest.fixture(params=["redis", "local"])
async def replicas(request):
    """Two Limiters: two replicas on one Redis, or one in-process Limiter twice."""
    if request.param == "local":
        one = Limiter(None)
        yield one, one
        return
    server = request.getfixturevalue("redis_server")
    clients = [client(server.url) for _ in range(2)]
    yield tuple(Limiter(c) for c in clients)
    for c in clients:
        await c.aclose()


@pytest.fixture
async def store(redis_server):
    """A third client, to read what the Limiters wrote."""
    c = client(redis_server.url)
    yield c
    await c.aclose()


async def admit_all(pair, limits: Limits, tokens: int = 1, key: str = "k") -> list[Decision]:
    """CALLERS admissions at once, alternating between the two replicas."""
    return await asyncio.gather(*(pair[i % 2].admit(key, limits, f"r{i}", tokens)
                                  for i in range(CALLERS)))


def admitted(decisions: list[Decision]) -> list[Decision]:
    return [d for d in decisions if d.admitted]


async def test_rpm_is_exact_across_replicas(replicas):
    decisions = await admit_all(replicas, Limits(rpm=5))
    assert len(admitted(decisions)) == 5
    for d in decisions:
        assert d.reservation is not None if d.admitted else d.reservation is None
        if not d.admitted:
            assert d.limit == "requests" and 0 < d.retry_after_s <= 60
            assert d.remaining_requests == 0 and d.retry_after_s == d.reset_requests_s
    assert all(d.reservation.local == (replicas[0] is replicas[1]) for d in admitted(decisions))


async def test_tpm_is_exact_and_corrected_by_finish(replicas):
    limits = Limits(tpm=100)
    decisions = await admit_all(replicas, limits, tokens=30)
    first = admitted(decisions)
    assert len(first) == 3
    assert {d.limit for d in decisions if not d.admitted} == {"tokens"}
    assert all(0 < d.retry_after_s <= 60 and not d.too_large for d in decisions if not d.admitted)
    # Which decision a replica made last depends on reply order; the counts do not.
    assert sorted(d.remaining_tokens for d in first) == [10, 40, 70]
    assert {d.remaining_tokens for d in decisions if not d.admitted} == {10}
    assert replicas[1].last("k").remaining_tokens in (10, 40, 70)
    # The first used no tokens: 60 reserved, so exactly one more of 30 fits.
    await replicas[0].finish(first[0].reservation, tokens_used=0)
    again = [await replicas[i % 2].admit("k", limits, f"again{i}", 30) for i in range(3)]
    assert [d.admitted for d in again] == [True, False, False]
    assert again[0].remaining_tokens == 10

    too_large = await replicas[0].admit("k", limits, "huge", 101)
    assert (too_large.admitted, too_large.limit, too_large.too_large) == (False, "tokens", True)
    fits_alone = await replicas[0].admit("other", limits, "whole", 100)
    assert fits_alone.admitted and fits_alone.remaining_tokens == 0


async def test_concurrency_is_exact_and_finish_frees_a_slot(replicas):
    limits = Limits(max_concurrency=4)
    decisions = await admit_all(replicas, limits)
    held = admitted(decisions)
    assert len(held) == 4
    assert all(d.limit == "concurrency" and d.retry_after_s >= 1
               for d in decisions if not d.admitted)
    await replicas[1].finish(held[0].reservation, tokens_used=1)
    assert (await replicas[0].admit("k", limits, "next", 1)).admitted
    assert not (await replicas[1].admit("k", limits, "one-too-many", 1)).admitted


async def test_a_refusal_changes_nothing(replicas, store):
    limits = Limits(rpm=10, tpm=50, max_concurrency=10)
    a, b = replicas
    assert (await a.admit("k", limits, "r1", 40)).admitted
    for i in range(5):  # refused by tokens, then by too_large: neither counts
        assert (await b.admit("k", limits, f"big{i}", 20)).limit == "tokens"
        assert (await b.admit("k", limits, f"huge{i}", 51)).too_large
    after = await a.admit("k", limits, "r2", 10)
    assert after.admitted
    assert (after.remaining_requests, after.remaining_tokens) == (8, 0)
    if a is not b:  # what Redis holds: the two admitted, and nothing of the ten refused
        key = f"{PREFIX}rl:k:"
        assert await store.zrange(key + "req", 0, -1) == [b"r1", b"r2"]
        assert await store.zrange(key + "conc", 0, -1) == [b"r1", b"r2"]
        assert await store.hgetall(key + "tokn") == {b"r1": b"40", b"r2": b"10"}
        for name in ("req", "tok", "tokn"):
            assert 0 < await store.pttl(key + name) <= 120_000
        assert await store.pttl(key + "conc") > limits_module.LEASE_S * 1000


async def test_unlimited_keys_never_touch_redis(redis_server, store):
    limiter = Limiter(client(redis_server.url))
    decision = await limiter.admit("k", Limits(), "r1", 10**9)
    assert decision.admitted and decision.reservation is None
    assert (decision.remaining_requests, decision.remaining_tokens) == (None, None)
    assert await store.dbsize() == 0 and limiter.last("k") == decision


async def test_renew_keeps_a_lease_and_an_unrenewed_one_lapses(redis_server, monkeypatch):
    monkeypatch.setattr(limits_module, "LEASE_S", 1.0)
    limits = Limits(max_concurrency=1)
    a, b = Limiter(client(redis_server.url)), Limiter(client(redis_server.url))
    assert (await a.admit("k", limits, "held", 1)).admitted
    await asyncio.sleep(0.6)
    await a.renew()  # the deadline moves to 1.6 s
    await asyncio.sleep(0.6)
    assert not (await b.admit("k", limits, "b1", 1)).admitted  # 1.2 s: held past its first lease
    await asyncio.sleep(1.0)  # a stops renewing, as a crashed replica would
    assert (await b.admit("k", limits, "b2", 1)).admitted  # 2.2 s: its lease lapsed


async def test_renew_recreates_a_lease_redis_lost_but_never_a_finished_one(redis_server, store):
    limiter, other = Limiter(client(redis_server.url)), Limiter(client(redis_server.url))
    one = Limits(max_concurrency=1)
    running = await limiter.admit("k", one, "r1", 1)
    done = await limiter.admit("j", one, "r2", 1)
    await limiter.finish(done.reservation, 1)
    await store.flushall()  # as a Redis restarted empty loses it
    await limiter.renew()
    # the request still running here holds its slot again, fleet-wide; the finished one does not
    assert (await other.admit("k", one, "r3", 1)).limit == "concurrency"
    assert await store.exists(f"{PREFIX}rl:j:conc") == 0
    await limiter.finish(running.reservation, 1)
    assert (await other.admit("k", one, "r4", 1)).admitted


async def test_a_release_redis_refused_is_retried_when_it_answers(redis_server, store,
                                                                  monkeypatch):
    """A client leaves while Redis is paused: its slot is freed once Redis answers, not a
    lease (LEASE_S) later."""
    monkeypatch.setattr(limits_module, "RETRY_REDIS_S", 0.3)
    limiter, other = Limiter(client(redis_server.url)), Limiter(client(redis_server.url))
    one = Limits(max_concurrency=1)
    held = await limiter.admit("k", one, "r1", 1)
    await store.client_pause(2000)  # every client waits; one that gives up is dropped
    await limiter.finish(held.reservation, 1)  # times out: kept to retry
    await asyncio.sleep(2.2)
    # Redis still holds the slot (a retry-less replica would leave it there for LEASE_S) ...
    assert (await other.admit("k", one, "r2", 1)).limit == "concurrency"
    # ... until this replica's next call to Redis releases it first
    assert (await limiter.admit("k", one, "r3", 1)).admitted


async def test_redis_killed_limits_hold_locally(redis_server, monkeypatch, caplog):
    monkeypatch.setattr(limits_module, "RETRY_REDIS_S", 0.3)
    limiter = Limiter(client(redis_server.url))
    rpm, one_at_a_time = Limits(rpm=3), Limits(max_concurrency=1)
    assert not (await limiter.admit("k", one_at_a_time, "before", 1)).reservation.local
    redis_server.kill()
    with caplog.at_level(logging.WARNING, logger=limits_module.__name__):
        decisions = [await limiter.admit("k", rpm, f"r{i}", 1) for i in range(4)]
        assert [d.admitted for d in decisions] == [True, True, True, False]
        assert all(d.reservation.local for d in decisions[:3])
        assert decisions[3].limit == "requests" and 0 < decisions[3].retry_after_s <= 60

        first = await limiter.admit("c", one_at_a_time, "c1", 1)
        assert first.reservation.local
        assert (await limiter.admit("c", one_at_a_time, "c2", 1)).limit == "concurrency"
        await limiter.finish(first.reservation, tokens_used=1)  # frees the local slot
        assert (await limiter.admit("c", one_at_a_time, "c3", 1)).admitted
        await limiter.renew()
        await limiter.finish(decisions[0].reservation, tokens_used=1)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one warning per outage"

    redis_server.restart()
    await asyncio.sleep(0.4)  # past RETRY_REDIS_S: Redis is asked again
    back = await limiter.admit("k", rpm, "r4", 1)
    assert back.admitted and not back.reservation.local


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (-1, "0s"), (0.02, "20ms"), (0.0004, "1ms"), (1, "1s"), (1.5, "1.5s"),
    (59.999, "59.999s"), (60, "1m0s"), (360, "6m0s"), (3723.25, "1h2m3.25s")])
def test_resets_are_formatted_as_openai_does(seconds, text):
    assert format_reset(seconds) == text


async def test_headers_name_only_the_limits_set():
    limiter = Limiter(None)
    both = Limits(rpm=2, tpm=100)
    decision = await limiter.admit("k", both, "r1", 40)
    assert rate_limit_headers(both, decision) == {
        "x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "0s",
        "x-ratelimit-limit-tokens": "100", "x-ratelimit-remaining-tokens": "60",
        "x-ratelimit-reset-tokens": "0s"}
    refused = await limiter.admit("k", both, "r2", 80)
    headers = rate_limit_headers(both, refused)
    assert headers["x-ratelimit-remaining-tokens"] == "60"
    assert headers["x-ratelimit-reset-tokens"] in ("1m0s", "59.999s", "59.998s")

    rpm_only = Limits(rpm=5)
    decision = await limiter.admit("k2", rpm_only, "r3", 1)
    assert set(rate_limit_headers(rpm_only, decision)) == {
        "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests"}
    assert rate_limit_headers(Limits(), await limiter.admit("k3", Limits(), "r4", 1)) == {}
