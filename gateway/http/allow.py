"""OPTIONS answers every method its path serves, in `Allow` (RFC 9110).

Litestar gives each route an OPTIONS handler when the route is first built; a handler added to
the same path later (another controller, or the next handler of one) rebuilds the route but
keeps that first OPTIONS handler, whose `Allow` then lists only the methods seen by then
(`/admin/adapters` answered `GET, OPTIONS` without its POST). This sets `Allow` on every
OPTIONS reply from the route the request matched, as the app holds it once built.
"""

from __future__ import annotations

import re

from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send

_TYPE = re.compile(r":[a-z]+}")  # "{alias:path}" in a route's path, "{alias}" in a template


class AllowHeader(ASGIMiddleware):
    scopes = ("http",)

    def __init__(self) -> None:
        self._allow: dict[str, bytes] | None = None  # route path -> its methods, once built

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        if scope["method"] != "OPTIONS":
            await next_app(scope, receive, send)
            return
        if self._allow is None:
            self._allow = {_TYPE.sub("}", route.path): ", ".join(sorted(route.methods)).encode()
                           for route in scope["litestar_app"].routes if hasattr(route, "methods")}
        allow = self._allow.get(_TYPE.sub("}", scope.get("path_template", "")))

        async def send_allow(message: Message) -> None:
            if allow is not None and message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"allow"]
                message = {**message, "headers": [*headers, (b"allow", allow)]}
            await send(message)

        await next_app(scope, receive, send_allow)
