"""Who a request acts as (a `Principal`, gateway/tenants/keys.py), resolved once per request by
the route's guard and kept in the request's state:

    --admin-key                 the operator: every adapter, every key, every route
    --api-key                   the operator's inference rights (and its admin rights when no
                                --admin-key is set, so admin routes are never left keyless)
    a tenant key (lgw-...)      its tenant's rights: DESIGN.md "Tenants"
    none of the above           anonymous with the operator's rights, only on a route no key
                                guards (no --api-key: /v1 is open; neither key: all is open)
    X-LoRAGW-Identity           a request another replica forwarded, signed with the fleet's
                                secret (gateway/tenants/forwarding.py): the key it names

401: no key, or a key nobody issued (or revoked, or rotated past its grace); 403: a valid key
on a route its role may not use (a member key on /admin/*). Static keys are compared in
constant time; a tenant key is looked up by its sha256. The scheme is case-insensitive (RFC
9110). Guards are coroutines: Litestar runs a sync guard in a worker thread.
"""

from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from loragw.gateway.common.config import ServerConfig
from loragw.gateway.common.errors import APIError
from loragw.gateway.tenants.access import forbidden
from loragw.gateway.tenants.forwarding import IDENTITY_HEADER, verify
from loragw.gateway.tenants.keys import (
    API_KEY_ID,
    KEY_PREFIX,
    OPEN_ID,
    OPERATOR,
    OPERATOR_ID,
    Principal,
)

FORWARDED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
PRINCIPAL = "principal"  # the request state's key of the caller
RATE_LIMIT_HEADERS = "rate_limit_headers"  # of the caller's limits, set by admission


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


def principal(connection: ASGIConnection) -> Principal:
    """The caller a guard resolved (the operator on a route no guard covers)."""
    return connection.scope.get("state", {}).get(PRINCIPAL, OPERATOR)


def _unauthorized(what: str, presented: bool) -> APIError:
    message = (f"incorrect {what} provided" if presented else
               f"no {what} provided; send it as `Authorization: Bearer KEY`")
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _static(config: ServerConfig, key_id: str) -> Principal | None:
    if key_id == OPERATOR_ID and config.admin_key is not None:
        return OPERATOR
    if key_id == API_KEY_ID and config.api_key is not None:
        return Principal(API_KEY_ID, None, "member" if config.admin_key else "admin")
    if key_id == OPEN_ID:  # an open server's caller is the operator; else on an open /v1 it
        # may use only shared adapters (tenants' own need their keys)
        if config.admin_key is None and config.api_key is None:
            return Principal(OPEN_ID, None, "admin")
        return Principal(OPEN_ID, "", "member")
    return None


async def _resolve(connection: ASGIConnection) -> tuple[Principal | None, str | None]:
    """(the caller a presented credential names, the bearer token presented)."""
    config: ServerConfig = connection.app.state.config
    token, signed = bearer_token(connection), connection.headers.get(IDENTITY_HEADER)
    if signed is None:
        if token is None:
            return None, None
        for key_id, key in ((OPERATOR_ID, config.admin_key), (API_KEY_ID, config.api_key)):
            if key is not None and key_matches(token, key):
                return _static(config, key_id), token
    tenants = connection.app.state.tenants
    if not tenants.started:
        raise APIError.not_ready("the tenant keys are being read")
    if signed is None:
        return await tenants.find(token), token
    if connection.scope["path"] not in FORWARDED_PATHS:
        raise _unauthorized("forwarded identity", True)
    body = await connection.body() if hasattr(connection, "body") else b""
    key_id = verify(tenants.forward_secret, signed, connection.scope["method"],
                    connection.scope["path"], body)
    found = key_id and (_static(config, key_id) or await tenants.by_id(key_id))
    if not found:
        raise _unauthorized("forwarded identity", True)
    return found, token


async def _guard(connection: ASGIConnection, key: str | None, what: str, admin: bool) -> None:
    """Resolve the caller; `key`: the static key that guards this route (None: open to
    anonymous callers, though a presented tenant key still has to be a valid one)."""
    found, token = await _resolve(connection)
    if found is None:
        if key is not None or (token or "").startswith(KEY_PREFIX):
            raise _unauthorized(what, token is not None)
        found = _static(connection.app.state.config, OPEN_ID)
    elif admin and found.key_id == API_KEY_ID and not found.admin:
        raise _unauthorized(what, True)  # the user key is not the admin key
    if admin and not found.admin:
        raise forbidden("this key serves requests only; admin routes need an admin key")
    connection.scope.setdefault("state", {})[PRINCIPAL] = found


async def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    config = connection.app.state.config
    await _guard(connection, config.api_key, "API key", admin=False)


async def require_admin_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    config = connection.app.state.config
    if config.admin_key is not None:
        await _guard(connection, config.admin_key, "admin key", admin=True)
    else:
        await _guard(connection, config.api_key, "API key", admin=True)


async def require_metrics_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    expected = connection.app.state.config.metrics_key
    if expected is None:
        return
    token = bearer_token(connection)
    if not key_matches(token, expected):
        raise _unauthorized("metrics key", token is not None)
