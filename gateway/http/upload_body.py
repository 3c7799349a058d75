"""The admin upload's body (POST /admin/adapters, multipart), read under rules of its own: at
most --max-upload-mb (413), and no pause of --upload-timeout-s between two pieces of it (408),
so a client that stalls mid-upload cannot hold a connection and a half-read form for ever.

Every other route's body is capped by the app's `request_max_body_size` (--max-request-mb);
the upload route turns that cap off and is wrapped in `UploadBody` instead. The rules apply as
the handler reads the body, so the route's guard (the admin key) answers first.
"""

from __future__ import annotations

import asyncio

from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from loragw.gateway.common.config import MB, ServerConfig
from loragw.gateway.common.errors import APIError


def too_large(config: ServerConfig) -> APIError:
    return APIError(413, f"the upload is larger than --max-upload-mb {config.max_upload_mb} MB; "
                         "upload a smaller adapter or restart the server with a larger limit",
                    code="request_too_large")


def timed_out(config: ServerConfig) -> APIError:
    return APIError(408, f"the upload sent nothing for --upload-timeout-s "
                         f"{config.upload_timeout_s:g} s, so it was cut off and nothing was "
                         "stored; send the whole body without pausing (or restart the server "
                         "with a larger --upload-timeout-s for a slow link)",
                    code="request_timeout")


def declared_length(scope: Scope) -> int | None:
    """The request's Content-Length, if it sent a well-formed one."""
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class UploadBody(ASGIMiddleware):
    """Reads of the body through `receive` raise the 413 or 408 above; the handler does not
    see them coming (Litestar's multipart parser reads through `receive`)."""

    scopes = ("http",)

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        config: ServerConfig = scope["litestar_app"].state.config
        limit = config.max_upload_mb * MB
        received = None  # bytes so far; None until the handler first reads

        async def receive_upload() -> Message:
            nonlocal received
            if received is None:
                if (declared_length(scope) or 0) > limit:
                    raise too_large(config)  # before a byte of it is read
                received = 0
            try:
                message = await asyncio.wait_for(receive(), config.upload_timeout_s)
            except TimeoutError:
                raise timed_out(config) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large(config)
            return message

        await next_app(scope, receive_upload, send)
