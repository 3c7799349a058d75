"""What an adapter source must be before anything is read from it, wherever it lives: a Hub
name that is well-formed (hf:// scheme, repo id, revision), an S3 URL that is (s3:// scheme,
bucket name, key prefix without traversal), and weights in safetensors, never a pickle (refused
by name, never opened).

Shared by adapters.sources (parsing source strings, local folders), adapters.hub (Hub repos) and
adapters.s3 / adapters.object_store (S3 folders, the shared store), so none imports another.
"""

from __future__ import annotations

import re

from loragw.adapters.errors import AdapterError, InvalidAdapterId
from loragw.adapters.errors import short_repr as _show
from loragw.adapters.ids import validate_adapter_id
from loragw.adapters.safetensors_check import WEIGHTS_FILE

HUB_SCHEME = "hf://"
S3_SCHEME = "s3://"
MAX_REPO_ID_LEN = 96  # the Hub's own limit
MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json, wherever it comes from
MAX_S3_PREFIX_LEN = 512  # S3 keys are at most 1024 bytes; leave room for blobs/<sha256>/<file>
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/-]{0,255}")
# S3's rules for general-purpose buckets (3-63 of [a-z0-9.-], a letter or digit at each end),
# plus '_' which GCS's S3 interop allows.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]")
_IPV4 = re.compile(r"\d{1,3}(\.\d{1,3}){3}")
_KEY_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")  # adapter-id rules: no '.', '..'
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


def validate_bucket(bucket: str) -> str:
    """An S3 bucket name: 3-63 of lowercase letters, digits, '.', '-' ('_' for GCS interop),
    a letter or digit at each end, no '..', not an IP address."""
    if not _BUCKET.fullmatch(bucket) or ".." in bucket or _IPV4.fullmatch(bucket):
        raise InvalidSource(
            f"S3 bucket name {_show(bucket)} is not valid: 3-63 lowercase letters, digits, '.'"
            " or '-', starting and ending with a letter or digit, no '..', not an IP address"
        )
    return bucket


def validate_key_prefix(prefix: str, where: str) -> str:
    """A key prefix ``a/b/c`` (no leading or trailing '/'): components of letters, digits,
    '.', '_', '-' that do not start with '.' or '-', so no '..' and no empty components."""
    if len(prefix) > MAX_S3_PREFIX_LEN:
        raise InvalidSource(
            f"{where}: the path is {len(prefix)} characters; at most {MAX_S3_PREFIX_LEN}"
        )
    for part in prefix.split("/"):
        if part in ("", ".", ".."):
            raise InvalidSource(
                f"{where}: the path has {'an empty' if not part else f'a {part!r}'} component;"
                " write s3://BUCKET/a/b/c with no '//', '.' or '..'"
            )
        if not _KEY_COMPONENT.fullmatch(part):
            raise InvalidSource(
                f"{where}: path component {_show(part)} must be letters, digits, '.', '_' or"
                " '-', not starting with '.' or '-'"
            )
    return prefix


def parse_s3_url(url: str, *, require_prefix: bool) -> tuple[str, str]:
    """``s3://BUCKET[/PREFIX][/]`` -> (bucket, prefix without slashes at either end; may be
    "" unless require_prefix). Raises InvalidSource (a ValueError) saying what is wrong."""
    if not isinstance(url, str) or not url.startswith(S3_SCHEME):
        raise InvalidSource(f"{_show(url)} is not an s3:// URL; write s3://BUCKET/PATH")
    where = f"S3 URL {_show(url)}"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in url) or "?" in url or "#" in url:
        raise InvalidSource(f"{where} contains control characters, '?' or '#'")
    bucket, _, prefix = url[len(S3_SCHEME) :].partition("/")
    validate_bucket(bucket)
    prefix = prefix[:-1] if prefix.endswith("/") else prefix
    if not prefix:
        if require_prefix:
            raise InvalidSource(
                f"{where} names a whole bucket; name the folder that holds the adapter's"
                " files: s3://BUCKET/PATH/"
            )
        return bucket, ""
    return bucket, validate_key_prefix(prefix, where)
