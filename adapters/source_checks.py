"""What an adapter source must be before anything is read from it, wherever it lives: a Hub
name that is well-formed (hf:// scheme, repo id, revision), and weights in safetensors, never a
pickle (refused by name, never opened).

Shared by adapters.sources (parsing source strings, local folders) and adapters.hub (Hub repos),
so neither has to import the other.
"""

from __future__ import annotations

import re

from adapters.errors import AdapterError, InvalidAdapterId
from adapters.errors import short_repr as _show
from adapters.ids import validate_adapter_id
from adapters.safetensors_check import WEIGHTS_FILE

HUB_SCHEME = "hf://"
MAX_REPO_ID_LEN = 96  # the Hub's own limit
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/-]{0,255}")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")  # refused, never opened


class InvalidSource(AdapterError):
    """The source string is malformed (HTTP 400)."""

    status = 400


def validate_repo_id(repo_id: str) -> str:
    """A Hub repo id: ``REPO`` or ``ORG/REPO`` under the adapter-id rules and the Hub's own."""
    try:
        validate_adapter_id(repo_id)
    except InvalidAdapterId as e:
        raise InvalidSource(f"Hub repo id: {e}") from None
    if len(repo_id) > MAX_REPO_ID_LEN or "--" in repo_id or ".." in repo_id:
        raise InvalidSource(
            f"Hub repo id {_show(repo_id)} is not valid on the Hub (at most {MAX_REPO_ID_LEN}"
            " characters, no '--' or '..')"
        )
    if repo_id.endswith((".", "-", ".git")):
        raise InvalidSource(f"Hub repo id {_show(repo_id)} must not end with '.', '-' or '.git'")
    return repo_id


def validate_revision(revision: str) -> str:
    """A branch, tag or commit: ``main``, ``v1.0``, ``refs/pr/3``, a 40-hex sha."""
    if not _REVISION.fullmatch(revision) or ".." in revision or "//" in revision:
        raise InvalidSource(
            f"revision {_show(revision)} is not a branch, tag or commit name"
            " (letters, digits, '.', '_', '-', '/'; no '..')"
        )
    return revision


def pickle_refusal(where: str, pickled: list[str]) -> str:
    return (
        f"adapter at {where} has pickled weights ({', '.join(pickled)}) and no {WEIGHTS_FILE};"
        " pickles are refused because unpickling can run arbitrary code; convert them to"
        f" {WEIGHTS_FILE}: load with PEFT in a trusted environment, then"
        " save_pretrained(dir, safe_serialization=True)"
    )
