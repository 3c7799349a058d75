"""Adapter ids: the one place that decides which names are safe to serve and to store on disk.

An id is ``NAME`` or ``ORG/NAME`` (like a Hub repo): 1-128 characters of ``[A-Za-z0-9._-]``
with at most one ``/``. Each component is non-empty, does not start with ``.`` or ``-`` (so no
``..``, no hidden files, no option-like names), so an id joined under the adapter directory
always stays inside it.
"""

from __future__ import annotations

import re

from loragw.adapters.errors import InvalidAdapterId, short_name

MAX_ADAPTER_ID_LEN = 128
_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
# The rule below as one regex (with MAX_ADAPTER_ID_LEN): what the OpenAPI document states
ADAPTER_ID_PATTERN = f"{_COMPONENT.pattern}(/{_COMPONENT.pattern})?"
_ALLOWED = "letters, digits, '.', '_', '-' and at most one '/' (like ORG/NAME)"


def valid_adapter_id(adapter_id: str) -> bool:
    try:
        validate_adapter_id(adapter_id)
    except InvalidAdapterId:
        return False
    return True


def validate_adapter_id(adapter_id: str) -> str:
    """Return ``adapter_id`` unchanged if it is safe; raise InvalidAdapterId naming the problem."""
    if not isinstance(adapter_id, str):
        raise InvalidAdapterId(f"adapter id must be a string, got {type(adapter_id).__name__}")
    if not adapter_id:
        raise InvalidAdapterId("adapter id is empty; use " + _ALLOWED)
    shown = short_name(adapter_id)
    if len(adapter_id) > MAX_ADAPTER_ID_LEN:
        raise InvalidAdapterId(
            f"adapter id {shown} has too many characters; at most {MAX_ADAPTER_ID_LEN}"
        )
    for ch in adapter_id:
        if ord(ch) < 0x20 or ord(ch) == 0x7F:
            raise InvalidAdapterId(f"adapter id {shown} contains control character {ch!r}")
    if "\\" in adapter_id:
        raise InvalidAdapterId(f"adapter id {shown} contains a backslash; use {_ALLOWED}")
    if not adapter_id.isascii():
        raise InvalidAdapterId(f"adapter id {shown} contains non-ASCII characters; use {_ALLOWED}")
    if adapter_id.startswith("/"):
        raise InvalidAdapterId(f"adapter id {shown} is an absolute path; use {_ALLOWED}")
    components = adapter_id.split("/")
    for part in components:
        if part in (".", ".."):
            raise InvalidAdapterId(f"adapter id {shown} contains a '{part}' path component")
        if not part:
            raise InvalidAdapterId(f"adapter id {shown} has an empty component; use {_ALLOWED}")
    if len(components) > 2:
        raise InvalidAdapterId(f"adapter id {shown} has more than one '/'; use {_ALLOWED}")
    for part in components:
        if part[0] in ".-":
            raise InvalidAdapterId(
                f"adapter id {shown}: component {part!r} must not start with '{part[0]}'"
            )
        if not _COMPONENT.fullmatch(part):
            bad = sorted({c for c in part if not (c.isalnum() or c in "._-")})
            raise InvalidAdapterId(f"adapter id {shown} contains {bad}; use {_ALLOWED}")
    return adapter_id
