"""`APIError`: a failure to answer with, its HTTP status, and what the client should do.

Anything on a request's way may raise one (adapter errors carry their own status too);
gateway/http/error_handlers.py turns each into OpenAI's error shape.
"""

from __future__ import annotations

import math

from loragw.adapters.errors import AdapterError, short_name

RETRY_AFTER_S = 1  # what a 429 or 503 asks the client to wait
# On a 429 for the caller's own key (value "key"): a forwarder relays it, since no replica
# would admit that key either; any other 429 is a full replica (gateway/fleet/router.py).
LIMIT_HEADER = "x-loragw-limit"


class APIError(Exception):
    """An error to answer with; the message says what was wrong and what to do."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.kind = kind  # OpenAI's error `type`; None: the one its status has

    @classmethod
    def bad_request(cls, message: str, param: str | None = None,
                    code: str | None = None) -> APIError:
        return cls(400, message, param=param, code=code)

    @classmethod
    def not_supported(cls, what: str, param: str) -> APIError:
        return cls(400, f"{what} is not supported yet; leave `{param}` out", param=param,
                   code="unsupported_parameter")

    @classmethod
    def model_not_found(cls, model: str) -> APIError:
        return cls(404, f"The model {short_name(model)} does not exist; GET /v1/models lists the base "
                        "model and the registered adapters", param="model",
                   code="model_not_found")

    @classmethod
    def not_ready(cls, detail: str) -> APIError:
        return cls(503, f"the server is not ready to serve: {detail}", code="not_ready",
                   headers={"Retry-After": str(RETRY_AFTER_S)})

    @classmethod
    def engine_gone(cls, detail: str, code: str = "engine_exited") -> APIError:
        """The engine died (its process, or a tensor-parallel rank) or stopped answering."""
        return cls(503, detail, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})

    @classmethod
    def overloaded(cls, capacity: int) -> APIError:
        return cls(429, f"the server is at capacity ({capacity} sequences running or queued); "
                        f"retry after {RETRY_AFTER_S} s", code="rate_limit_exceeded",
                   headers={"Retry-After": str(RETRY_AFTER_S)})

    @classmethod
    def rate_limited(cls, message: str, retry_after_s: float,
                     headers: dict[str, str]) -> APIError:
        """Over one of a key's limits (DESIGN.md, Tenants): OpenAI's body and headers."""
        return cls(429, message, code="rate_limit_exceeded", kind="rate_limit_exceeded",
                   headers={"Retry-After": str(max(1, math.ceil(retry_after_s))),
                            LIMIT_HEADER: "key", **headers})

    @classmethod
    def from_engine(cls, exc: ValueError) -> APIError | ValueError:
        """The answer to an engine refusal: InvalidParam names its parameter (and code); an
        AdapterError keeps its own status (its exception handler answers it)."""
        if isinstance(exc, AdapterError):
            return exc
        return cls(400, str(exc), param=getattr(exc, "param", None),
                   code=getattr(exc, "code", None))
