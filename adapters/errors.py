"""Adapter errors, each carrying the HTTP status and the error `code` the gateway answers with."""

from __future__ import annotations


class AdapterError(ValueError):
    """The adapter is invalid for this server or its base model (HTTP 422).

    The message says what was wrong and what to do; the gateway sends it to the client as is.
    """

    status: int = 422
    code: str = "invalid_adapter"


class AdapterNotFound(AdapterError):
    """No adapter by that id, or no files at that path (HTTP 404)."""

    status = 404
    code = "adapter_not_found"


class InvalidAdapterId(AdapterError):
    """The adapter id itself is malformed or unsafe to use as a path (HTTP 400)."""

    status = 400
    code = "invalid_adapter_id"


class StoreUnavailable(AdapterError):
    """The store holding the adapter's bytes (the fleet's S3 bucket, an s3:// source) cannot be
    reached now, or asks to retry later (HTTP 503, with Retry-After): nothing is wrong with
    the adapter."""

    status = 503
    code = "adapter_store_unavailable"


NAME_SHOWN = 64  # characters of a client's model or adapter name an error message echoes


def short_name(name: str) -> str:
    """A name a client sent (a model, an adapter id) as an error message shows it: quoted, with
    control and non-ASCII characters escaped, and cut to NAME_SHOWN characters plus its length,
    so a 200,000-character `model` is not echoed back whole."""
    if len(name) <= NAME_SHOWN:
        return ascii(name)
    return f"{ascii(name[:NAME_SHOWN])}... ({len(name)} characters)"


def short_repr(value: object, limit: int = 160) -> str:
    """repr() of an untrusted value, cut short so error messages and logs stay small."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"
