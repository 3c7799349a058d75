"""An overall deadline for reading any request body (JSON or an upload), so a client that drips
its body a byte at a time cannot hold a connection for ever: the body must have arrived within
--upload-timeout-s plus --body-seconds-per-mb for each MB received so far (408 past it). That is
a minimum average rate once past the first --upload-timeout-s; a drip at 1 byte/s is cut off
at about --upload-timeout-s, while a 512 MB upload at 17 MB/s or so is never near the line.

The deadline applies while the body is being read; once its last piece is in, reads (a
handler waiting for the client to disconnect) pass through untouched.
"""

from __future__ import annotations

import asyncio
import time

from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from loragw.gateway.common.config import MB, ServerConfig
from loragw.gateway.common.errors import APIError


def too_slow(config: ServerConfig, received: int, elapsed: float) -> APIError:
    return APIError(408, f"the request body arrived too slowly ({received} bytes in "
                         f"{elapsed:.1f} s): a body must arrive within --upload-timeout-s "
                         f"{config.upload_timeout_s:g} s plus --body-seconds-per-mb "
                         f"{config.body_seconds_per_mb:g} s per MB, so it was cut off; send it "
                         "faster (or restart the server with larger limits for a slow link)",
                    code="request_timeout")


class BodyDeadline(ASGIMiddleware):
    """Each read of the body waits no longer than what is left of the body's deadline."""

    scopes = ("http",)

    def __init__(self, config: ServerConfig) -> None:
        self.config = config

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        config = self.config
        started: float | None = None  # when the handler first read (its guard answers first)
        received, done = 0, False

        async def receive_body() -> Message:
            nonlocal started, received, done
            if done:
                return await receive()
            now = time.monotonic()
            started = now if started is None else started
            deadline = (started + config.upload_timeout_s
                        + received / MB * config.body_seconds_per_mb)
            try:
                message = await asyncio.wait_for(receive(), max(deadline - now, 0.0))
            except TimeoutError:
                raise too_slow(config, received, time.monotonic() - started) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                done = not message.get("more_body", False)
            else:
                done = True  # a disconnect: nothing more to wait for
            return message

        await next_app(scope, receive_body, send)
