"""Bearer-key guards: `--api-key` on /v1/*, `--admin-key` on /admin/* and adapter load/unload,
`--metrics-key` on /metrics.

Keys are compared in constant time; the scheme is case-insensitive (RFC 9110: `bearer KEY`
is `Bearer KEY`). The admin guard falls back to the API key when no admin key is set (so a
server with only --api-key never leaves its admin routes open to keyless callers), and is open
when neither is set. /metrics is open without --metrics-key; /health and /ready carry no guard.
Guards are coroutines: Litestar runs a sync guard in a worker thread, a round trip per request.
"""

from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from gateway.config import ServerConfig
from gateway.errors import APIError


def bearer_token(connection: ASGIConnection) -> str | None:
    header = connection.headers.get("authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def key_matches(presented: str | None, expected: str) -> bool:
    if presented is None:
        return False
    return hmac.compare_digest(presented.encode("utf-8"), expected.encode("utf-8"))


def _require(connection: ASGIConnection, expected: str | None, what: str) -> None:
    if expected is None:
        return
    token = bearer_token(connection)
    if token is None:
        raise APIError(401, f"no {what} provided; send it as `Authorization: Bearer KEY`",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    if not key_matches(token, expected):
        raise APIError(401, f"incorrect {what} provided", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


def _config(connection: ASGIConnection) -> ServerConfig:
    return connection.app.state.config


async def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    _require(connection, _config(connection).api_key, "API key")


async def require_admin_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    config = _config(connection)
    if config.admin_key is not None:
        _require(connection, config.admin_key, "admin key")
    else:
        _require(connection, config.api_key, "API key")


async def require_metrics_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    _require(connection, _config(connection).metrics_key, "metrics key")
