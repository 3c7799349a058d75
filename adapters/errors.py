"""Adapter errors, each carrying the HTTP status the gateway answers with."""

from __future__ import annotations


class AdapterError(ValueError):
    """The adapter is invalid for this server or its base model (HTTP 422).

    The message says what was wrong and what to do; the gateway sends it to the client as is.
    """

    status: int = 422


class AdapterNotFound(AdapterError):
    """No adapter by that id, or no files at that path (HTTP 404)."""

    status = 404


class InvalidAdapterId(AdapterError):
    """The adapter id itself is malformed or unsafe to use as a path (HTTP 400)."""

    status = 400


def short_repr(value: object, limit: int = 160) -> str:
    """repr() of an untrusted value, cut short so error messages and logs stay small."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"
