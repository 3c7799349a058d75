"""Every failure in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `APIError` (or let AdapterError / Litestar's HTTP exceptions through); the
exception handlers below turn each into the right status and body. Unexpected exceptions are
logged with the request id and answered with a 500 that names it.
"""

from __future__ import annotations

import logging

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import ResponseSpec

from loragw.adapters.errors import AdapterError
from loragw.gateway.common.errors import RETRY_AFTER_S, APIError
from loragw.gateway.http.response_bodies import ErrorBody, ErrorResponse

logger = logging.getLogger(__name__)

# OpenAI's error `type` per status.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
          409: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable_error"}
# What each status means, for the OpenAPI document (a route may say it more precisely).
MEANINGS = {400: "invalid body or parameter (`param` names it), or a request this server "
                 "cannot run (a prompt past the context window, more sequences than it runs)",
            401: "the key (`Authorization: Bearer KEY`) is missing or wrong",
            403: "a valid key doing what its role may not (a member key on /admin/*, a write "
                 "outside its tenant's namespace, another tenant's keys)",
            404: "no such model or adapter (or one this key may not use)",
            408: "the upload paused longer than --upload-timeout-s; nothing was stored",
            409: "the adapter is in use, pinned or exists",
            413: "the body is larger than --max-request-mb (an upload: --max-upload-mb)",
            422: "the adapter is not valid for this base model",
            429: "at capacity, or over this key's limits (`rate_limit_exceeded`, with "
                 "x-ratelimit-* headers); retry after Retry-After seconds",
            502: "the adapter's source (the Hub, S3) failed or sent bytes that do not verify",
            503: "not ready (the model is loading), the adapter store cannot be reached "
                 "(`adapter_store_unavailable`), or no replica holding the adapter answers; "
                 "retry after Retry-After seconds"}


def error_responses(*statuses: int, **meanings: str) -> dict[int, ResponseSpec]:
    """OpenAPI `responses=` for a route: OpenAI's error body at each status, in place of
    Litestar's default `{status_code, detail}` (which the handlers below never send).
    `meanings` overrides a status's text, keyed `e404="unknown model"`."""
    return {status: ResponseSpec(ErrorResponse, generate_examples=False,
                                 description=meanings.get(f"e{status}", MEANINGS[status]))
            for status in statuses}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None,
                   kind: str | None = None) -> Response[ErrorResponse]:
    kind = kind or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    body = ErrorResponse(ErrorBody(message=message, type=kind, param=param, code=code))
    return Response(body, status_code=status, headers=headers)


def _api_error(_: Request, exc: APIError) -> Response[ErrorResponse]:
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers, exc.kind)


def _adapter_error(_: Request, exc: AdapterError) -> Response[ErrorResponse]:
    retry = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
    return error_response(exc.status, str(exc), code=exc.code, headers=retry)


def _http_error(request: Request, exc: HTTPException) -> Response[ErrorResponse]:
    status = exc.status_code
    message, param = str(exc.detail), None
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
        # Litestar's extra: [{"message": "Expected `float` <= 1.0", "key": "top_p", ...}]
        first = exc.extra[0] if isinstance(exc.extra[0], dict) else {}
        param = first.get("key") or None
        details = "; ".join(_describe(e) for e in exc.extra)
        message = f"invalid request body: {details}"
    elif status == 413:  # the app's cap; the upload route has its own (upload_body.py)
        limit = request.app.state.config.max_request_mb
        message = (f"the request body is larger than --max-request-mb {limit} MB; send a "
                   "smaller body (fewer or shorter prompts) or restart the server with a "
                   "larger --max-request-mb")
    code = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed",
            413: "request_too_large"}.get(status)
    return error_response(status, message, param, code, exc.headers)


def _describe(entry: object) -> str:
    if not isinstance(entry, dict):
        return str(entry)
    key, text = entry.get("key"), entry.get("message", "invalid value")
    return f"{text} (at `{key}`)" if key else str(text)


def _unexpected(request: Request, exc: Exception) -> Response[ErrorResponse]:
    request_id = request.scope.get("state", {}).get("request_id", "?")
    logger.exception("unhandled error in %s %s (request id %s)", request.method,
                     request.url.path, request_id, exc_info=exc)
    return error_response(500, f"internal server error ({type(exc).__name__}); the server "
                               f"logged it under request id {request_id}", code="internal_error")


EXCEPTION_HANDLERS = {
    APIError: _api_error,
    AdapterError: _adapter_error,
    HTTPException: _http_error,
    Exception: _unexpected,
}

