"""The SERVER span of each OpenAI API request (/v1/*), with --otlp-traces-endpoint only.

Added to the app by create_app only when the replica traces (gateway/observe/tracing.py), so a server
without the flag runs none of this. The span is current while the route runs, so admission's
spans, a forward's CLIENT span and the engine's phase spans nest under it; it ends when the
response's last byte is sent (a stream's too). Probes and /metrics are not traced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from opentelemetry.trace import Status, StatusCode

from loragw.gateway.common.records import AdapterRecord, Location
from loragw.gateway.observe.tracing import Tracing

TRACED_PREFIX = "/v1/"
_PROPAGATED = (b"traceparent", b"tracestate")


class TracingMiddleware(ASGIMiddleware):
    scopes = ("http",)

    def __init__(self, tracing: Tracing, records: Callable[[], Mapping[str, AdapterRecord]]):
        """records: this replica's adapters now (for the located adapter's attributes)."""
        self.tracing, self.records = tracing, records

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        if not scope["path"].startswith(TRACED_PREFIX):
            await next_app(scope, receive, send)
            return
        status = 500

        async def send_watching(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        headers = {k.decode("latin-1"): v.decode("latin-1")
                   for k, v in scope.get("headers", ()) if k in _PROPAGATED}
        with self.tracing.server_span(scope["method"], scope["path"], headers) as span:
            try:
                await next_app(scope, receive, send_watching)
            finally:
                route = scope.get("path_template") or scope["path"]
                span.update_name(f"{scope['method']} {route}")
                span.set_attributes({"http.route": route, "http.response.status_code": status,
                                     **self._request_attributes(scope.get("state", {}))})
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))

    def _request_attributes(self, state: dict) -> dict[str, object]:
        """The client's model and, once admission located it, the adapter and its version."""
        out: dict[str, object] = {}
        if state.get("model") is not None:
            out["gen_ai.request.model"] = state["model"]
        if "request_id" in state:
            out["loragw.request_id"] = state["request_id"]
        location: Location | None = state.get("location")  # set once served here
        if location is not None:
            out.update(self.tracing.located(location, self.records()))
        if state.get("forwarded"):
            out["loragw.forwarded"] = True
        return out
