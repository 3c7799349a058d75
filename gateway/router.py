"""Adapter-affinity routing: send each request to the replica that already holds its adapter.

Every replica scores every live replica in the registry (`score`), and `choose` picks a remote
one only when it beats serving here by `FORWARD_MARGIN`. `Router.maybe_forward` then proxies
the request there (body, headers and auth as received, plus `X-LoRAGW-Forwarded`), streaming the
upstream bytes back as they arrive. One hop at most: a request carrying the marker is always
served where it lands. A target that cannot be reached, or answers 5xx/429 before any byte, is
forgotten for this request and we serve locally. The in-process registry never forwards.

The residency manager (gateway/adapter_manager.py) publishes each replica's state; with the
plain resolver, `Router` publishes it itself from engine snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from litestar import Request, Response
from litestar.response import Stream

from adapters.registry import Registry, ReplicaState, make_registry

logger = logging.getLogger(__name__)

FORWARDED_HEADER = "x-loragw-forwarded"  # value: the replica id that forwarded the request
SERVED_BY_HEADER = "x-served-by"  # value: the replica id whose engine generated the response

# Affinity scores (gateway-api-inference-extension's LoRA scorer).
SCORE_RESIDENT = 1.0  # adapter in a device slot (or the base model: always resident)
SCORE_FREE_SLOT = 0.8  # an empty device slot: a load, but no eviction
SCORE_LOADING = 0.6  # the adapter is being loaded there right now
SCORE_NONE = 0.0  # every slot taken by other adapters: a load and an eviction
# Each waiting request lowers a replica's score, so a hot adapter spreads once a replica queues:
# two waiting requests cost a resident replica its lead over an idle replica's free slot.
QUEUE_PENALTY = 0.05
# Forward only when the best remote replica beats this one by more than this; ties stay local.
FORWARD_MARGIN = 0.1
# How long one read of the registry's replica states is reused (a Redis round trip each).
STATES_CACHE_S = 0.2

CONNECT_TIMEOUT_S = 1.0  # a replica that does not accept within this is treated as down
READ_TIMEOUT_S = 600.0  # between two upstream bytes (a long non-streamed generation)
PUBLISH_INTERVAL_S = 0.5
# Not copied onto a forwarded request or back from its response: hop-by-hop, or recomputed.
_HOP_HEADERS = frozenset({"host", "connection", "keep-alive", "transfer-encoding", "te",
                          "content-length", "upgrade", "proxy-connection", "date", "server"})
_FALLBACK_STATUSES = frozenset({429})  # plus every 5xx: the target is full or failing


def score(state: ReplicaState, adapter: str | None) -> float:
    """Affinity of `adapter` (None: the base model) for the replica `state` describes."""
    if adapter is None or adapter in state.resident:
        base = SCORE_RESIDENT
    elif adapter in state.loading:
        base = SCORE_LOADING
    elif state.free_slots > 0:
        base = SCORE_FREE_SLOT
    else:
        base = SCORE_NONE
    return base - QUEUE_PENALTY * state.queue_depth


def choose(states: list[ReplicaState], self_id: str, adapter: str | None) -> ReplicaState | None:
    """The remote replica to forward to, or None to serve here. Unknown local state (not yet
    published) serves here: we cannot tell whether forwarding would help."""
    local = next((s for s in states if s.replica_id == self_id), None)
    remotes = [s for s in states if s.replica_id != self_id and s.url]
    if local is None or not remotes:
        return None
    best = max(remotes, key=lambda s: (score(s, adapter), s.replica_id))
    if score(best, adapter) > score(local, adapter) + FORWARD_MARGIN:
        return best
    return None


@dataclass(frozen=True, slots=True)
class RouterConfig:
    replica_id: str
    advertise_url: str
    redis_url: str | None
    base_name: str  # the `model` name of the base model


class Router:
    """Owns the forwarding HTTP client. Reads replica states from the residency manager's
    registry (`runtime.resolver.registry`) when there is one; otherwise (the plain resolver)
    it opens its own registry and publishes this replica's state itself."""

    def __init__(self, config: RouterConfig, runtime=None, registry: Registry | None = None,
                 publish_interval_s: float = PUBLISH_INTERVAL_S):
        self.config, self.runtime, self.registry = config, runtime, registry
        self.replica_id = config.replica_id
        self.fleet = bool(config.redis_url)  # the in-process registry never forwards
        self.publish_interval_s = publish_interval_s
        self.client: httpx.AsyncClient | None = None
        self._owned: Registry | None = None  # the registry we opened (and so close)
        self._states: list[ReplicaState] = []
        self._states_at = -1e9

    @classmethod
    def from_server_config(cls, config, runtime=None) -> Router:
        """From a gateway ServerConfig: --redis-url, --replica-id, --advertise-url."""
        replica_id = config.replica_id or socket.gethostname()
        url = config.advertise_url or f"http://{config.host}:{config.port}"
        return cls(RouterConfig(replica_id, url.rstrip("/"), config.redis_url,
                                config.model_name), runtime)

    @asynccontextmanager
    async def lifespan(self, _app=None) -> AsyncIterator[Router]:
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(
            READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S, pool=CONNECT_TIMEOUT_S))
        attach = None
        if self.registry is None and self.runtime is not None and self.fleet:
            attach = asyncio.create_task(self._attach(), name="router-attach")
        try:
            yield self
        finally:
            if attach is not None:
                attach.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await attach
            await self.client.aclose()
            if self._owned is not None:
                await self._owned.close()

    async def _attach(self) -> None:
        """Once the runtime is ready: adopt its registry, or open one and publish to it."""
        while not self.runtime.ready:
            await asyncio.sleep(0.05)
        shared = getattr(self.runtime.resolver, "registry", None)
        if shared is not None:
            self.registry = shared
            return
        self._owned = make_registry(self.config.redis_url, self.replica_id)
        await self._owned.start()
        self.registry = self._owned
        await self._publish_loop()

    # ---- routing -------------------------------------------------------------------------
    def adapter_of(self, model: str) -> str | None:
        return None if model == self.config.base_name else model

    async def route(self, request: Request, model: str) -> Response | None:
        """The forwarded response for this completion request, or None to serve it here."""
        headers = dict(request.headers)
        rid = request.scope.get("state", {}).get("request_id")
        if rid and "x-request-id" not in headers:
            headers["x-request-id"] = rid  # the target logs the same id
        return await self.maybe_forward(await request.body(), headers, request.scope["path"],
                                        self.adapter_of(model))

    async def maybe_forward(self, request_body: bytes, headers: Mapping[str, str], path: str,
                            adapter: str | None) -> Response | None:
        if (not self.fleet or self.registry is None or self.client is None
                or _has_header(headers, FORWARDED_HEADER)):
            return None
        target = choose(await self.states(), self.replica_id, adapter)
        if target is None:
            return None
        out = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
        out[FORWARDED_HEADER] = self.replica_id
        upstream_request = self.client.build_request("POST", target.url + path,
                                                     content=request_body, headers=out)
        try:
            upstream = await self.client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            logger.warning("forward of %s to %s (%s) failed: %s; serving locally", path,
                           target.replica_id, target.url, exc)
            return None
        if upstream.status_code >= 500 or upstream.status_code in _FALLBACK_STATUSES:
            await upstream.aclose()
            logger.warning("replica %s answered %d to a forwarded %s; serving locally",
                           target.replica_id, upstream.status_code, path)
            return None
        headers_back = {k: v for k, v in upstream.headers.items()
                        if k.lower() not in _HOP_HEADERS and k.lower() != "content-type"}
        headers_back.setdefault(SERVED_BY_HEADER, target.replica_id)
        return Stream(_relay(upstream), status_code=upstream.status_code, headers=headers_back,
                      media_type=upstream.headers.get("content-type", "application/json"))

    async def states(self) -> list[ReplicaState]:
        """Live replica states, read from the registry at most every STATES_CACHE_S."""
        now = asyncio.get_running_loop().time()
        if now - self._states_at > STATES_CACHE_S:
            self._states, self._states_at = await self.registry.replicas(), now
        return self._states

    # ---- publishing (until the residency manager does it) ---------------------------------
    async def local_state(self) -> ReplicaState | None:
        runtime = self.runtime
        if runtime is None or not runtime.ready:
            return None
        snapshot = await runtime.snapshot()
        if snapshot is None:
            return None
        resident = tuple(sorted(n for n, where in snapshot.residency.items() if where == "device"))
        return ReplicaState(self.replica_id, self.config.advertise_url, resident, loading=(),
                            free_slots=max(0, snapshot.slots_total - len(resident)),
                            queue_depth=snapshot.num_waiting, updated_at=0.0)

    async def _publish_loop(self) -> None:
        assert self.registry is not None
        last: ReplicaState | None = None
        while True:
            try:
                state = await self.local_state()
                if state is not None and state != last:
                    await self.registry.publish_state(state)
                    last = state
            except Exception:  # a bug must not stop publishing: the replica would vanish
                logger.exception("router: publishing this replica's state failed")
            await asyncio.sleep(self.publish_interval_s)


async def _relay(upstream: httpx.Response) -> AsyncIterator[bytes]:
    """The upstream body as it arrives; the upstream connection closes when we stop."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()


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

