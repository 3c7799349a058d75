"""Strict admin requests: a body decoded as msgspec decodes it with strict=True (no "10" for an
int, no 1.0 for an int), and integer query parameters written as plain decimal integers (no
`?limit=1e3`). Litestar itself converts a handler's `data` and query parameters with
strict=False; this hook runs first (a controller's `before_request`) and refuses what the lax
conversion would have coerced, with a 400 naming the field. What it lets through is then
converted by Litestar to the same values.
"""

from __future__ import annotations

import re
import typing

import msgspec
from litestar import Request

from loragw.gateway.common.errors import APIError

_DECIMAL = re.compile(r"[+-]?[0-9]{1,19}")
_PATH = re.compile(r" - at `\$\.?(.*)`$")


async def strict_body(request: Request) -> None:
    """Refuse a coercible body or query value of the route's handler (None: go on)."""
    params = request.route_handler.parsed_fn_signature.parameters
    for name, value in request.query_params.items():
        field = params.get(name)
        if field is not None and _is_int(field.annotation) and not _DECIMAL.fullmatch(value):
            raise APIError.bad_request(f"{name} must be a decimal integer, got {value[:40]!r}",
                                       param=name)
    data = params.get("data")
    if data is None:
        return
    raw = await request.body()  # cached: Litestar's own decoding reads it again for free
    if not raw.strip():
        return  # no body: Litestar's rule (a default, or its 400)
    try:
        msgspec.json.decode(raw, type=data.annotation, strict=True)
    except msgspec.ValidationError as exc:
        where = _PATH.search(str(exc))
        raise APIError.bad_request(f"invalid request body: {exc}",
                                   param=where.group(1) if where else None) from None
    except msgspec.DecodeError:
        return  # not JSON: Litestar's own 400 says so


def _is_int(annotation) -> bool:
    args = typing.get_args(annotation)
    return annotation is int or (bool(args) and int in args and bool not in args)
