"""The Litestar app: routes, their dependencies, guards, OpenAI-shaped errors, request ids and
access logs.

`create_app(config)` owns its Services through its lifespan. `create_app(config, services=s)`
serves already running Services without owning them (a second front end on the same engine:
tests with other keys, the benchmark).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable

from litestar import Litestar
from litestar.datastructures import State
from litestar.middleware import ASGIMiddleware
from litestar.openapi import OpenAPIConfig
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from loragw.adapters.errors import short_name
from loragw.gateway.admin.adapters import AdminController
from loragw.gateway.admin.aliases import AliasController
from loragw.gateway.admin.placement import PlacementController
from loragw.gateway.admin.tenants import AuditController, TenantKeyController
from loragw.gateway.common.config import MB, ServerConfig
from loragw.gateway.fleet.router import served_by_hook
from loragw.gateway.http.allow import AllowHeader
from loragw.gateway.http.auth import PRINCIPAL, RATE_LIMIT_HEADERS
from loragw.gateway.http.body_deadline import BodyDeadline
from loragw.gateway.http.error_handlers import EXCEPTION_HANDLERS
from loragw.gateway.http.ops import OpsController
from loragw.gateway.http.outcome import Outcome, tracking
from loragw.gateway.observe.metrics import CLIENT_CLOSED_REQUEST, STREAM_FAILED, Metrics
from loragw.gateway.openai.routes import AdapterLoadController, OpenAIController
from loragw.gateway.openai.utility import UtilityController
from loragw.gateway.responses.routes import ResponsesController
from loragw.gateway.services import Services
from loragw.gateway.tenants.service import Tenants

access_log = logging.getLogger("loragw.gateway.access")
REQUEST_ID_HEADER = b"x-request-id"
MODEL_LOGGED = 256  # characters of a client's `model` an access-log line carries
_CLIENT_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces


def request_id(scope: Scope) -> str:
    """The client's X-Request-Id when it is sane, else a new one; stored in the scope."""
    state = scope.setdefault("state", {})
    rid = state.get("request_id")
    if rid is None:
        for key, value in scope.get("headers", ()):
            if key == REQUEST_ID_HEADER:
                text = value.decode("latin-1")
                rid = text if _CLIENT_REQUEST_ID.fullmatch(text) else None
                break
        rid = state["request_id"] = rid or uuid.uuid4().hex
    return rid


def _with_request_id(message: Message, rid: str) -> Message:
    headers = list(message.get("headers") or ())
    if not any(key.lower() == REQUEST_ID_HEADER for key, _ in headers):
        headers.append((REQUEST_ID_HEADER, rid.encode("latin-1")))
    return {**message, "headers": headers}


def recorded_status(sent: int, ended: bool, gone: bool, outcome: Outcome) -> int:
    """The status a request is logged and counted under: CLIENT_CLOSED_REQUEST if its client
    went away before the response ended (a stream it abandoned), STREAM_FAILED if the response
    failed after its status line went out (a stream the engine cut short), else the status
    sent."""
    if gone and not ended:
        return CLIENT_CLOSED_REQUEST
    return STREAM_FAILED if outcome.failed_after_headers else sent


class RequestContextMiddleware(ASGIMiddleware):
    """Request id in and out, one JSON access-log line and the request counters per request,
    under the status `recorded_status` gives."""

    scopes = ("http",)

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        rid = request_id(scope)
        state = scope["state"]
        started = state["arrival"] = time.monotonic()
        status, ended, gone = 500, False, False

        async def receive_watching() -> Message:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def send_with_id(message: Message) -> None:
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = message["status"]
                message = _with_request_id(message, rid)
            await send(message)
            ended = ended or (message["type"] == "http.response.body"
                              and not message.get("more_body", False))

        with tracking() as outcome:
            try:
                await next_app(scope, receive_watching, send_with_id)
            finally:
                self._record(scope, rid, recorded_status(status, ended, gone, outcome), started)

    def _record(self, scope: Scope, rid: str, status: int, started: float) -> None:
        state = scope["state"]
        route = scope.get("path_template") or scope["path"]
        self.metrics.http_requests.labels(route, str(status)).inc()
        if "location" in state:
            location = state["location"]
            self.metrics.count_request(location.adapter_id, location.version, status)
        caller = state.get(PRINCIPAL)
        if caller is not None and not state.get("forwarded"):
            self.metrics.tenant_requests.labels(caller.metrics_label, str(status)).inc()
        fields = {"request_id": rid, "method": scope["method"], "route": route,
                  "key_id": caller.key_id if caller is not None else None,
                  "model": _shown(state.get("model")), "adapter": state.get("adapter"),
                  "status": status, "latency_ms": round((time.monotonic() - started) * 1e3, 2)}
        access_log.info(json.dumps(fields), extra=fields)


def _shown(model: str | None) -> str | None:
    """A client's `model` as the access log shows it: whole when short, else cut (a log line
    per request must stay a line)."""
    return model if model is None or len(model) <= MODEL_LOGGED else short_name(model)


async def _unrouted_request_id(message: Message, scope: Scope) -> None:
    """before_send hook: requests that matched no route (404/405) get an id too."""
    if message["type"] == "http.response.start" and "arrival" not in scope.get("state", {}):
        rid = request_id(scope)
        message["headers"] = _with_request_id(message, rid)["headers"]
        access_log.info(json.dumps({"request_id": rid, "method": scope.get("method"),
                                    "path": scope.get("path"), "status": message["status"]}))


def rate_limit_hook(tenants: Tenants):
    """A before_send hook: OpenAI's x-ratelimit-* headers on every response of a key with
    limits (admission's own for a generation, else as the key's last admission left them),
    unless the response has them already (a 429, a forwarded response)."""
    async def add_rate_limit_headers(message: Message, scope: Scope) -> None:
        if message["type"] != "http.response.start":
            return
        state = scope.get("state", {})
        caller = state.get(PRINCIPAL)
        if caller is None or not caller.limits.active:
            return
        headers = list(message.get("headers") or ())
        if any(k.lower().startswith(b"x-ratelimit-") for k, _ in headers):
            return
        ours = state.get(RATE_LIMIT_HEADERS) or await tenants.headers(caller)
        message["headers"] = headers + [(k.encode(), v.encode()) for k, v in ours.items()]

    return add_rate_limit_headers


def traced(services: Services) -> list[ASGIMiddleware]:
    """The SERVER-span middleware when the replica traces (--otlp-traces-endpoint); imported
    only then, so a server without the flag loads no tracing code."""
    if services.tracing is None:
        return []
    from loragw.gateway.http.tracing_middleware import TracingMiddleware

    def records():
        return services.adapters.records if services.adapters is not None else {}

    return [TracingMiddleware(services.tracing, records)]


def create_app(config: ServerConfig, services: Services | None = None,
               on_fatal: Callable[[BaseException], None] | None = None) -> Litestar:
    """The app; `on_fatal` is called if start-up fails (the server should then exit). Routes
    get what they ask for by name from `Services.dependencies` (`config` is this app's: a second
    front end may have other keys); the guards read the config and the tenant keys from the
    app's state."""
    owned = services is None
    services = services or Services(config, on_fatal=on_fatal)
    return Litestar(
        route_handlers=[OpenAIController, ResponsesController, UtilityController,
                        AdapterLoadController, OpsController, AdminController,
                        TenantKeyController, AuditController, AliasController,
                        PlacementController],
        lifespan=[services.lifespan] if owned else [],
        state=State({"config": config, "tenants": services.tenants, "services": services}),
        dependencies=services.dependencies(config),
        exception_handlers=EXCEPTION_HANDLERS,
        middleware=[RequestContextMiddleware(services.metrics), *traced(services),
                    BodyDeadline(config), AllowHeader()],
        before_send=[_unrouted_request_id, served_by_hook(config.replica),
                     rate_limit_hook(services.tenants)],
        request_max_body_size=config.max_request_mb * MB,  # the upload route has its own
        openapi_config=OpenAPIConfig(title="lora-gateway", version="0.1.0",
                                     description="OpenAI-compatible multi-LoRA serving"),
        logging_config=None,
    )
