"""Adapter-affinity routing: send each request to the replica that already holds its adapter.

Every replica scores every live replica in the registry (`score`: the adapter's tier there,
less its queue), and `choose` picks a remote one only when it beats serving here by
`FORWARD_MARGIN`; an adapter the placement plan gives copies goes to one of them instead
(gateway/fleet/placing.py: spread, or by `user`). `Router.route` then proxies the
request there (body, headers and auth as received, plus `X-LoRAGW-Forwarded`), streaming the
upstream bytes back as they arrive. An adapter this replica cannot fetch (an upload without a
shared store) goes to the replicas that hold it instead, best first; when none answers, a 503
names the adapter and why. One whose store is down right now goes to its holders first too;
when none answers, this replica tries the store itself (and answers its 503). One hop at most: a request carrying the marker is always served
where it lands. Forwarding never turns a servable request into an error: a target that cannot
be reached, or answers 401, 404, 429 (unless the caller's key is over its limits: relayed) or
5xx before any byte, is forgotten for this request and the next candidate, or this replica,
serves it. The in-process registry never forwards.

The router reads replica states only; the residency manager (gateway/residency/manager.py)
publishes this replica's.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import httpx
from litestar import Request, Response
from litestar.response import Stream

from loragw.adapters.registry import Registry, ReplicaState
from loragw.gateway.common.errors import LIMIT_HEADER, APIError
from loragw.gateway.fleet.placement import rendezvous
from loragw.gateway.tenants.forwarding import IDENTITY_HEADER

if TYPE_CHECKING:  # imported only when tracing
    from loragw.gateway.observe.tracing import ClientSpan, Tracing

logger = logging.getLogger(__name__)

FORWARDED_HEADER = "x-loragw-forwarded"  # value: the replica id that forwarded the request
SERVED_BY_HEADER = "x-served-by"  # value: the replica id whose engine generated the response

# Affinity scores (gateway-api-inference-extension's LoRA scorer), by the tier the adapter is
# in there: device > host > disk > store (a free slot to fetch it into) > none.
SCORE_RESIDENT = 1.0  # adapter in a device slot (or the base model: always resident)
SCORE_HOST = 0.9  # in host memory: a slot fill
SCORE_DISK = 0.85  # on its disk: a read and parse, then a slot fill
SCORE_FREE_SLOT = 0.8  # an empty device slot: a load, but no eviction
SCORE_LOADING = 0.6  # the adapter is being loaded there right now
SCORE_NONE = 0.0  # every slot taken by other adapters: a load and an eviction
# Each waiting request lowers a replica's score, so a hot adapter spreads once a replica queues:
# two waiting requests cost a resident replica its lead over an idle replica's free slot.
QUEUE_PENALTY = 0.05
# Forward only when the best remote replica beats this one by more than this; ties stay local.
FORWARD_MARGIN = 0.1
# An adapter the placement plan gives copies: each request goes to one of the copies scoring
# within this of the best (a request's `user` always to the same one, by rendezvous hash; else
# drawn), so its traffic spreads over them while none queues much deeper than the rest; when
# every copy scores this much below the best replica (their queues grew faster than the plan),
# the request overflows by affinity.
SPREAD_SLACK = 0.25
# How long one read of the registry's replica states is reused (a Redis round trip each).
STATES_CACHE_S = 0.2

CONNECT_TIMEOUT_S = 1.0  # a replica that does not accept within this is treated as down
READ_TIMEOUT_S = 600.0  # between two upstream bytes (a long non-streamed generation)
# Not copied onto a forwarded request or back from its response: hop-by-hop, or recomputed.
_HOP_HEADERS = frozenset({"host", "connection", "keep-alive", "transfer-encoding", "te",
                          "content-length", "upgrade", "proxy-connection", "date", "server"})
# plus every 5xx: the target is full or failing, (404) does not know the adapter yet, or (401)
# does not know the caller's key yet (this replica checked it)
_FALLBACK_STATUSES = frozenset({401, 404, 429})


def score(state: ReplicaState, adapter: str | None) -> float:
    """Affinity of `adapter` (None: the base model) for the replica `state` describes."""
    if adapter is None or adapter in state.resident:
        base = SCORE_RESIDENT
    elif adapter in state.loading:
        base = SCORE_LOADING
    elif adapter in state.host:
        base = SCORE_HOST
    elif adapter in state.held:
        base = SCORE_DISK
    elif state.free_slots > 0:
        base = SCORE_FREE_SLOT
    else:
        base = SCORE_NONE
    return base - QUEUE_PENALTY * state.queue_depth


def choose(states: list[ReplicaState], self_id: str, adapter: str | None,
           copies: tuple[str, ...] = (), user: str | None = None,
           rng: random.Random | None = None) -> ReplicaState | None:
    """The remote replica to forward to, or None to serve here. Unknown local state (not yet
    published) serves here: we cannot tell whether forwarding would help. `copies`: the
    replicas the placement plan assigns `adapter` (spread over, see SPREAD_SLACK)."""
    local = next((s for s in states if s.replica_id == self_id), None)
    remotes = [s for s in states if s.replica_id != self_id and s.url]
    if local is None or not remotes:
        return None
    scores = {s.replica_id: score(s, adapter) for s in (local, *remotes)}  # once per state
    planned = [s for s in (local, *remotes) if s.replica_id in copies]
    top = max((scores[s.replica_id] for s in planned), default=None)
    # every copy queued deep (demand rose faster than the plan): overflow by affinity
    if adapter is not None and top is not None and top >= max(scores.values()) - SPREAD_SLACK:
        ready = sorted((s for s in planned if scores[s.replica_id] >= top - SPREAD_SLACK),
                       key=lambda s: s.replica_id)
        pick = (max(ready, key=lambda s: rendezvous(f"{adapter}\0{user}", s.replica_id))
                if user else (rng or random).choice(ready))
        return None if pick is local else pick
    best = max(remotes, key=lambda s: (scores[s.replica_id], s.replica_id))
    if scores[best.replica_id] > scores[self_id] + FORWARD_MARGIN:
        return best
    return None


class Router:
    """Forwards a request to the replica `choose` picks, through one pooled HTTP client (open
    between `start` and `close`). `fleet` is False without Redis: nothing to forward to.
    With `tracing`, each forward is a CLIENT span whose `traceparent` the target continues."""

    def __init__(self, registry: Registry, replica_id: str, fleet: bool,
                 tracing: Tracing | None = None,
                 copies: Callable[[str], tuple[str, ...]] = lambda adapter: ()):
        self.registry, self.replica_id, self.fleet = registry, replica_id, fleet
        self.copies = copies  # adapter -> the replicas the placement plan assigns it
        self.tracing = tracing
        self.client: httpx.AsyncClient | None = None
        self._states: list[ReplicaState] = []
        self._states_at = -1e9

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Router]:
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(
            READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S, pool=CONNECT_TIMEOUT_S))
        try:
            yield self
        finally:
            await self.client.aclose()
            self.client = None

    async def route(self, request: Request, adapter: str | None, here: bool = True,
                    holders: tuple[str, ...] = (),
                    identity: Callable[[bytes], str] | None = None,
                    extra: Mapping[str, str] | None = None,
                    user: str | None = None) -> Response | None:
        """The forwarded response for this completion request (for `adapter`, None: the base
        model), or None to serve it here. `here`: this replica can serve it; if not, only the
        replicas in `holders` can, and a 503 says so when none of them answers. `here` with
        `holders`: they are tried first (best first, not by affinity), then this replica.
        `identity(body)`: the caller's signed identity, sent in place of its Authorization
        (gateway/tenants/forwarding.py); a client's own identity header never travels on.
        `extra`: headers added to a forward (an alias's drawn target). `user`: the request's,
        which keeps a user's requests on one of the adapter's copies."""
        headers = {k: v for k, v in request.headers.items() if k.lower() != IDENTITY_HEADER}
        headers |= extra or {}
        rid = request.scope.get("state", {}).get("request_id")
        if rid and "x-request-id" not in headers:
            headers["x-request-id"] = rid  # the target logs the same id
        candidates: list[ReplicaState] = []
        if self.fleet and self.client is not None and not _has_header(headers, FORWARDED_HEADER):
            states = await self.states()
            if here and not holders:
                copies = self.copies(adapter) if adapter is not None else ()
                target = choose(states, self.replica_id, adapter, copies, user)
                candidates = [target] if target is not None else []
            else:
                candidates = sorted((s for s in states if s.replica_id in holders and s.url
                                     and s.replica_id != self.replica_id),
                                    key=lambda s: -score(s, adapter))
        body = await request.body() if candidates else b""
        if candidates and identity is not None:
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            headers[IDENTITY_HEADER] = identity(body)
        for target in candidates:
            forwarded = await self._forward(target, body, headers, request.scope["path"],
                                            adapter)
            if forwarded is not None:
                return forwarded
        if here:
            return None
        held = ", ".join(holders) or "no replica that is alive"
        raise APIError(503, f"adapter {adapter!r} is held only by {held} (it was uploaded or "
                            "registered from a path there, and the fleet has no shared "
                            "--adapter-store-url), and none of them can serve it now; retry "
                            "later, or register it again", code="adapter_unavailable",
                       headers={"Retry-After": "1"})

    async def _forward(self, target: ReplicaState, request_body: bytes,
                       headers: Mapping[str, str], path: str,
                       adapter: str | None = None) -> Response | None:
        """The target's streamed response, or None if it failed before the first byte."""
        out = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
        out[FORWARDED_HEADER] = self.replica_id
        span = (self.tracing.forward(target.replica_id, target.url + path, out, adapter)
                if self.tracing is not None else None)
        upstream_request = self.client.build_request("POST", target.url + path,
                                                     content=request_body, headers=out)
        try:
            upstream = await self.client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            logger.warning("forward of %s to %s (%s) failed: %s", path, target.replica_id,
                           target.url, exc)
            if span is not None:
                span.failed(f"{type(exc).__name__}: {exc}")
            return None
        if (upstream.status_code >= 500 or upstream.status_code in _FALLBACK_STATUSES) \
                and not _over_key_limit(upstream):
            await upstream.aclose()
            logger.warning("replica %s answered %d to a forwarded %s", target.replica_id,
                           upstream.status_code, path)
            if span is not None:
                span.failed(f"answered {upstream.status_code}")
            return None
        headers_back = {k: v for k, v in upstream.headers.items()
                        if k.lower() not in _HOP_HEADERS and k.lower() != "content-type"}
        headers_back.setdefault(SERVED_BY_HEADER, target.replica_id)
        return Stream(_relay(upstream, span), status_code=upstream.status_code,
                      headers=headers_back,
                      media_type=upstream.headers.get("content-type", "application/json"))

    async def states(self) -> list[ReplicaState]:
        """Live replica states, read from the registry at most every STATES_CACHE_S."""
        now = asyncio.get_running_loop().time()
        if now - self._states_at > STATES_CACHE_S:
            self._states, self._states_at = await self.registry.replicas(), now
        return self._states


async def _relay(upstream: httpx.Response, span: ClientSpan | None) -> AsyncIterator[bytes]:
    """The upstream body as it arrives; the upstream connection closes (and the forward's
    span ends) when we stop."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()
        if span is not None:
            span.relayed(upstream.status_code)


def _over_key_limit(upstream: httpx.Response) -> bool:
    """A 429 for the caller's key (its limits hold fleet-wide: no other replica would admit
    it either), told from a full replica's 429 by the mark only a key's refusal carries (a
    max_concurrency-only key has no x-ratelimit-* headers to tell it by)."""
    return upstream.status_code == 429 and upstream.headers.get(LIMIT_HEADER) == "key"


def _has_header(headers: Mapping[str, str], name: str) -> bool:
    return any(k.lower() == name for k in headers)


def served_by_hook(replica_id: str):
    """A Litestar before_send hook: `X-Served-By: <replica_id>` on every response that does not
    already carry one (a forwarded response keeps its target's)."""
    value = replica_id.encode("latin-1")

    async def add_served_by(message, _scope) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers") or ())
            if not any(k.lower() == SERVED_BY_HEADER.encode() for k, _ in headers):
                headers.append((SERVED_BY_HEADER.encode(), value))
                message["headers"] = headers

    return add_served_by

