"""Tenants' limits across a fleet, tested as an attacker would (DESIGN.md "Tenants"): rpm, tpm
and concurrency hold exactly across two replicas under 64 callers, a forwarded request is
served and counted once, and forged forwarding headers give a client nothing. Each test mints
the keys it limits. The fleet and its world (tenant_fleet.py) are shared with the other
test_tenants_fleet* modules.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time

import httpx
import pytest
from fleet_harness import served_by
from held_streams import HeldStream, hold
from tenant_fleet import (
    BASE,
    OP,
    PROMPT,
    RIDS,
    TenantFleet,
    assert_rate_limited,
    call,
    complete,
    error,
    fleet_fixture,  # noqa: F401 (a fixture)
    key,
    minted,
    revoked_fixture,  # noqa: F401 (a fixture)
    unchanged,
    wait_until,
    world_fixture,  # noqa: F401 (a fixture)
)

from loragw.gateway.fleet.router import FORWARDED_HEADER
from loragw.gateway.tenants.forwarding import IDENTITY_HEADER, sign

pytestmark = pytest.mark.slow  # replica processes on one redis-server

CALLERS = 64
REQUEST_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                   "x-ratelimit-reset-requests")
TOKEN_HEADERS = ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens",
                 "x-ratelimit-reset-tokens")





async def burst(fleet: TenantFleet, by: str, bodies: list[dict]) -> list[httpx.Response]:
    """POST /v1/completions for every body at once, alternating r1 and r2."""
    limits = httpx.Limits(max_connections=len(bodies) + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(
            client.post(fleet.urls[RIDS[i % 2]] + "/v1/completions", json=body,
                        headers={"Authorization": f"Bearer {by}"})
            for i, body in enumerate(bodies)))


# ---- 6. limits hold across the fleet ----------------------------------------------------------
@pytest.mark.usefixtures("world")
def test_rpm_is_exact_across_replicas_under_64_callers(fleet):
    limited = minted(fleet, "r1", "acme", key(fleet, "acme-admin"), role="member", rpm=5)
    bodies = [{"model": BASE, "prompt": PROMPT, "max_tokens": 2} for _ in range(CALLERS)]
    responses = asyncio.run(burst(fleet, limited["key"], bodies))
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert len(ok) == 5, sorted(r.status_code for r in responses)
    for response in refused:
        assert_rate_limited(response, REQUEST_HEADERS)
        assert response.headers["x-ratelimit-remaining-requests"] == "0"
        assert response.headers["x-ratelimit-limit-requests"] == "5"
        assert not any(h in response.headers for h in TOKEN_HEADERS)  # no tpm on this key
    for response in ok:
        assert all(h in response.headers for h in REQUEST_HEADERS), dict(response.headers)
    assert sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in ok) == [0, 1, 2, 3, 4]
    for rid in RIDS:  # and on its other responses too
        response = call(fleet, rid, "GET", "/v1/models", limited["key"])
        assert response.status_code == 200
        assert response.headers.get("x-ratelimit-limit-requests") == "5", dict(response.headers)
        assert_rate_limited(complete(fleet, rid, limited["key"]), REQUEST_HEADERS)


@pytest.mark.usefixtures("world")
def test_concurrency_is_exact_across_replicas_under_64_callers_and_a_gone_client_frees_its_slot(
        fleet):
    limited = minted(fleet, "r1", "acme", key(fleet, "acme-admin"), role="member",
                     max_concurrency=2)
    streams = [HeldStream(fleet, RIDS[i % 2], limited["key"]) for i in range(CALLERS)]
    try:
        for stream in streams:
            stream.start()
        for stream in streams:
            assert stream.answered.wait(60)
        admitted = [s for s in streams if s.status == 200]
        assert sorted(s.status for s in streams) == [200] * 2 + [429] * (CALLERS - 2)
        for stream in streams:
            if stream.status == 429:
                assert stream.response.json()["error"]["code"] == "rate_limit_exceeded"
                assert int(stream.response.headers["retry-after"]) >= 1
        assert_rate_limited(complete(fleet, "r1", limited["key"]))
        assert_rate_limited(complete(fleet, "r2", limited["key"]))

        admitted[0].close()  # the client goes mid-stream
        gone = time.monotonic()
        wait_until("a slot to free after the client left", lambda: complete(
            fleet, "r2", limited["key"], max_tokens=1).status_code == 200, timeout=3)
        assert time.monotonic() - gone < 3
        assert not admitted[1].closed.is_set()  # the other stream still holds its slot
        streams.append(hold(fleet, "r1", limited["key"]))  # the freed slot, taken again
        assert streams[-1].status == 200
        streams.append(hold(fleet, "r2", limited["key"], tries=1))  # and the limit holds
        assert streams[-1].status == 429
    finally:
        for stream in streams:
            stream.close()


@pytest.mark.usefixtures("world")
def test_tpm_admits_exactly_what_the_reservations_predict_under_64_callers(fleet):
    tpm = 200
    limited = minted(fleet, "r1", "acme", key(fleet, "acme-admin"), role="member", tpm=tpm)
    counted = call(fleet, "r1", "POST", "/tokenize", limited["key"],
                   json={"model": BASE, "prompt": PROMPT})
    prompt_tokens = counted.json()["count"]
    each = 60  # prompt + max_tokens reserved per request; ignore_eos: all of it is used
    body = {"model": BASE, "prompt": PROMPT, "max_tokens": each - prompt_tokens,
            "ignore_eos": True, "temperature": 0}
    responses = asyncio.run(burst(fleet, limited["key"], [body] * CALLERS))
    ok = [r for r in responses if r.status_code == 200]
    assert len(ok) == tpm // each, sorted(r.status_code for r in responses)
    for response in ok:
        assert response.json()["usage"]["total_tokens"] == each
        assert all(h in response.headers for h in TOKEN_HEADERS)
        assert not any(h in response.headers for h in REQUEST_HEADERS)  # no rpm on this key
    for response in responses:
        if response.status_code != 200:
            assert_rate_limited(response, TOKEN_HEADERS)
    left = tpm - len(ok) * each  # 20: a request reserving exactly that fits, then nothing
    fits = complete(fleet, "r2", limited["key"], max_tokens=left - prompt_tokens,
                    ignore_eos=True)
    assert fits.status_code == 200, fits.text
    assert fits.headers["x-ratelimit-remaining-tokens"] == "0"
    for rid in RIDS:
        assert_rate_limited(complete(fleet, rid, limited["key"], max_tokens=1), TOKEN_HEADERS)
    # a request that could never fit says so
    huge = complete(fleet, "r1", limited["key"], max_tokens=tpm)
    assert_rate_limited(huge, TOKEN_HEADERS)
    assert "max_tokens" in error(huge)["message"]


# ---- 7. a forwarded request is counted once ---------------------------------------------
def spend_through_forwards(fleet: TenantFleet, limited: dict) -> None:
    """The rpm=2 key `limited`'s two requests for acme/bot, each through r2 to r1."""
    for _ in range(2):
        response = complete(fleet, "r2", limited["key"], "acme/bot")
        assert served_by(response) == "r1"
        assert all(h in response.headers for h in REQUEST_HEADERS)


@pytest.fixture
def forwarded_to_its_limit(world, fleet) -> dict:
    """An acme member key (rpm=2, acme/bot only) that has made both its requests, forwarded."""
    limited = minted(fleet, "r1", "acme", key(fleet, "acme-admin"), role="member", rpm=2,
                     adapters=["acme/bot"])
    spend_through_forwards(fleet, limited)
    return limited


@pytest.mark.usefixtures("world")
def test_a_forwarded_request_is_served_and_counted_once(fleet):
    # acme/bot's bytes are on r1 only (no shared store): r2 forwards every request for it
    assert fleet.redis.hget(f"{fleet.prefix()}catalog", "acme/bot") is not None
    assert call(fleet, "r2", "GET", "/admin/adapters/acme/bot", OP).json()["holder"] == "r1"
    limited = minted(fleet, "r1", "acme", key(fleet, "acme-admin"), role="member", rpm=2,
                     adapters=["acme/bot"])
    spend_through_forwards(fleet, limited)
    assert_rate_limited(complete(fleet, "r1", limited["key"], "acme/bot"), REQUEST_HEADERS)


def test_a_forwarded_request_over_its_limit_gets_the_429(fleet, forwarded_to_its_limit):
    response = complete(fleet, "r2", forwarded_to_its_limit["key"], "acme/bot")
    assert_rate_limited(response, REQUEST_HEADERS)


@pytest.mark.usefixtures("world")
def test_a_concurrency_only_key_forwarded_to_the_sole_holder_gets_its_429(fleet):
    """No x-ratelimit-* headers (no rpm or tpm) to tell the key's 429 from a full replica's:
    the holder's own mark does, and the forwarder relays it rather than answering 503."""
    limited = minted(fleet, "r1", "acme", key(fleet, "acme-admin"), role="member",
                     max_concurrency=1)
    held = hold(fleet, "r1", limited["key"])
    try:
        assert held.status == 200
        response = complete(fleet, "r2", limited["key"], "acme/bot")  # only r1 holds it
        assert_rate_limited(response)
        assert response.headers["x-served-by"] == "r1"
        assert not any(h.startswith("x-ratelimit-") for h in response.headers)
    finally:
        held.close()


@pytest.mark.usefixtures("world")
def test_a_key_minted_a_moment_ago_is_served_through_a_forward(fleet):
    fresh = minted(fleet, "r2", "acme", key(fleet, "acme-admin"), role="member")
    response = complete(fleet, "r2", fresh["key"], "acme/bot")
    assert response.status_code == 200, response.text
    assert served_by(response) == "r1"


# ---- 8. the forwarding headers give a client nothing ------------------------------------
@pytest.mark.usefixtures("world", "revoked")
def test_forged_forwarding_headers_are_refused(fleet):
    member = fleet.keys["acme-member"]
    now = int(time.time())
    forged = {IDENTITY_HEADER: f"operator.{now}.{'0' * 64}"}
    with unchanged(fleet):
        for rid in RIDS:
            for by in (None, member["key"], OP):
                assert complete(fleet, rid, by, headers=forged).status_code == 401
                for method, path, kw in (
                        ("GET", "/admin/adapters", {}), ("GET", "/v1/models", {}),
                        ("POST", "/admin/tenants/globex/keys", {"json": {"role": "admin"}}),
                        ("DELETE", "/admin/adapters/acme/bot", {}),
                        ("GET", "/admin/audit", {})):
                    response = call(fleet, rid, method, path, by, headers=forged, **kw)
                    assert response.status_code == 401, (rid, by, method, path, response.text)
            marker = {FORWARDED_HEADER: "r1"}
            assert complete(fleet, rid, None, headers=marker).status_code == 401
            assert call(fleet, rid, "GET", "/admin/adapters",
                        headers=marker).status_code == 401
            assert call(fleet, rid, "GET", "/admin/adapters", member["key"],
                        headers=marker).status_code == 403
            hidden = complete(fleet, rid, key(fleet, "globex-admin"), "acme/bot",
                              headers={**marker})
            assert hidden.status_code == 404, hidden.text

        # with the fleet's secret (whoever reads Redis has it): a signature binds the key id,
        # the method, the path, the body and the time; a revoked key stays revoked
        secret = fleet.redis.get("loragw:forward-secret")
        assert secret
        body = b'{"model": "demo-base", "prompt": "hi", "max_tokens": 1}'
        json_type = {"Content-Type": "application/json"}

        def signed(key_id: str, path: str = "/v1/completions", content: bytes = body,
                   method: str = "POST", stamp: int | None = None) -> dict:
            if stamp is None:
                return {**json_type, IDENTITY_HEADER: sign(secret, key_id, method, path,
                                                           content)}
            message = "\n".join((key_id, str(stamp), method, path,
                                 hashlib.sha256(content).hexdigest())).encode()
            mac = hmac.new(secret, message, hashlib.sha256).hexdigest()
            return {**json_type, IDENTITY_HEADER: f"{key_id}.{stamp}.{mac}"}

        def post(headers: dict, path: str = "/v1/completions", content: bytes = body) -> int:
            return call(fleet, "r2", "POST", path, headers=headers, content=content).status_code

        assert post(signed(member["id"])) == 200  # the mechanism itself works
        assert post(signed(member["id"]), content=body.replace(b"hi", b"ho")) == 401
        assert post(signed(member["id"], "/tokenize"), "/v1/completions") == 401
        assert post(signed(member["id"], method="GET")) == 401
        assert post(signed(member["id"], stamp=int(time.time()) - 600)) == 401
        assert post(signed(fleet.keys["victim"]["id"])) == 401  # revoked (`revoked`)
        assert post(signed("key_" + "0" * 16)) == 401
        wrong = {**json_type, IDENTITY_HEADER: sign(b"x" * 64, "operator", "POST",
                                                    "/v1/completions", body)}
        assert post(wrong) == 401
