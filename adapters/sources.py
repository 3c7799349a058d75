"""Where adapter files come from: a local directory, a Hugging Face Hub repo or an S3 folder.

A source string (``--adapter NAME=SOURCE``, ``POST /admin/adapters/register``, vLLM's
``lora_path``) is one of::

    /abs/dir  ./rel/dir  ../rel/dir  ~/dir      a local PEFT folder; must exist
    hf://ORG/REPO  hf://ORG/REPO@REV  hf://REPO the Hub, at a branch, tag or commit
    ORG/REPO                                    the Hub, unless a directory by that name exists
    s3://BUCKET/PATH/                           an S3 (or S3-compatible) folder; endpoint and
                                                credentials from the AWS variables and chain

`resolve_source` turns a parsed source into the two files' bytes plus the provenance the store
records; callers validate them (adapters.format.parse_adapter) before storing anything.
Uploads skip this module: the admin API already holds the bytes. huggingface_hub and boto3 are
imported only when a Hub or S3 source is resolved.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from typing import Literal

from loragw.adapters.chat_files import CHAT_FILES, MAX_CHAT_FILE_BYTES
from loragw.adapters.errors import AdapterError, AdapterNotFound, InvalidAdapterId
from loragw.adapters.errors import short_repr as _show
from loragw.adapters.ids import validate_adapter_id
from loragw.adapters.safetensors_check import CONFIG_FILE, WEIGHTS_FILE
from loragw.adapters.source_checks import (
    HUB_SCHEME,
    MAX_CONFIG_BYTES,
    PICKLE_SUFFIXES,
    S3_SCHEME,
    InvalidSource,
    parse_s3_url,
    pickle_refusal,
    validate_repo_id,
    validate_revision,
)

_FORMS = "a local directory, hf://ORG/REPO[@REVISION], ORG/REPO or s3://BUCKET/PATH/"
S3_ID_PREFIX = "s3."  # s3_adapter_id: ORG is "s3.BUCKET"


@dataclass(frozen=True)
class AdapterSource:
    kind: Literal["local", "hub", "s3"]
    path: str | None = None  # kind == "local": absolute, normalized
    repo_id: str | None = None  # kind == "hub"
    revision: str | None = None  # kind == "hub": branch, tag or commit; None = the default branch
    bucket: str | None = None  # kind == "s3"
    key: str | None = None  # kind == "s3": the folder's key prefix, no '/' at either end

    def __post_init__(self) -> None:
        assert (self.kind == "local") == (self.path is not None)
        assert (self.kind == "hub") == (self.repo_id is not None)
        assert (self.kind == "s3") == (self.bucket is not None) == (self.key is not None)
        assert self.revision is None or self.kind == "hub"

    @property
    def uri(self) -> str:
        if self.kind == "local":
            return self.path
        if self.kind == "s3":
            return f"{S3_SCHEME}{self.bucket}/{self.key}/"
        return HUB_SCHEME + self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter's two files, not yet validated, and where they came from."""

    config_raw: bytes  # adapter_config.json
    weights_raw: bytes  # adapter_model.safetensors
    origin: str  # what the store records: "/abs/dir", "hf://ORG/REPO@<sha>", "s3://B/PATH/"
    revision: str | None  # the revision asked for (hub), the weights' ETag (s3), None (local)
    # the chat files the folder also holds (adapters/chat_files.py CHAT_FILES), by name
    chat_files: dict[str, bytes] = field(default_factory=dict)


def parse_source(source: str, *, allow_local: bool = True) -> AdapterSource:
    """Parse a source string; an existing directory wins over a Hub repo of the same name.

    allow_local=False refuses explicit paths and reads ORG/REPO as a Hub repo whatever the
    server's disk holds (for sources that arrive over HTTP from clients who should not name,
    or probe for, files on the server).
    """
    if not isinstance(source, str) or not source.strip():
        raise InvalidSource(f"adapter source is empty; give {_FORMS}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in source):
        raise InvalidSource(f"adapter source {_show(source)} contains control characters")
    if source.startswith(HUB_SCHEME):
        repo_id, sep, revision = source[len(HUB_SCHEME) :].partition("@")
        if sep and not revision:
            raise InvalidSource(f"adapter source {_show(source)} has an empty revision after '@'")
        return AdapterSource(
            "hub", repo_id=validate_repo_id(repo_id), revision=validate_revision(revision) if sep else None
        )  # fmt: skip
    if source.startswith(S3_SCHEME):
        bucket, key = parse_s3_url(source, require_prefix=True)
        return AdapterSource("s3", bucket=bucket, key=key)
    if "://" in source:
        raise InvalidSource(
            f"adapter source {_show(source)}: only hf:// and s3:// URLs are supported"
        )
    expanded = os.path.expanduser(source)
    explicit_path = source.startswith(("/", "./", "../", "~")) or source in (".", "..")
    if explicit_path or (allow_local and os.path.isdir(expanded)):
        if not allow_local:
            raise InvalidSource(
                f"adapter source {_show(source)} is a local path, which is not accepted here;"
                " upload the files or name a Hub repo (hf://ORG/REPO) or S3 folder (s3://B/PATH/)"
            )
        if not os.path.isdir(expanded):
            raise AdapterNotFound(f"no adapter directory at {_show(source)}")
        return AdapterSource("local", path=os.path.abspath(expanded))
    if "@" in source:
        raise InvalidSource(
            f"adapter source {_show(source)}: write a revision as hf://ORG/REPO@REV"
        )
    if source.count("/") != 1:
        raise InvalidSource(
            f"adapter source {_show(source)} is neither an existing directory nor ORG/REPO;"
            f" give {_FORMS}"
        )
    return AdapterSource("hub", repo_id=validate_repo_id(source))


def hub_allowed(repo_id: str, patterns: list[str]) -> bool:
    """Whether ``--hub-allow`` lets requests fetch repo_id on demand.

    Patterns are case-sensitive fnmatch globs over the whole id: ``my-org/*``, ``*/llama-*``,
    ``*``. No patterns (the default) allows nothing; an invalid repo id is never allowed.
    """
    try:
        validate_repo_id(repo_id)
    except InvalidSource:
        return False
    return any(fnmatch.fnmatchcase(repo_id, pattern) for pattern in patterns)


def s3_allowed(uri: str, patterns: list[str]) -> bool:
    """Whether ``--s3-allow`` lets requests fetch the S3 folder ``uri`` on demand.

    Patterns are case-sensitive fnmatch globs over ``BUCKET/PATH`` (no scheme, no trailing
    '/'): ``my-bucket/adapters/*``, ``*``. No patterns allows nothing; an invalid URL never is.
    """
    try:
        bucket, key = parse_s3_url(uri, require_prefix=True)
    except InvalidSource:
        return False
    return any(fnmatch.fnmatchcase(f"{bucket}/{key}", pattern) for pattern in patterns)


def s3_adapter_id(bucket: str, path: str) -> str:
    """The adapter id an on-demand ``model="s3://BUCKET/PATH"`` is served under:
    ``s3.BUCKET/PATH`` with each '/' of PATH written as '--'.

    Injective, so two folders never share an id: a PATH component may not contain '--' or end
    with '-' (then every '--' in the id is a separator). Raises InvalidSource for paths that
    cannot map to a valid id.
    """
    bucket, key = parse_s3_url(f"{S3_SCHEME}{bucket}/{path}", require_prefix=True)
    where = f"s3://{bucket}/{key}/"
    parts = key.split("/")
    if any("--" in part or part.endswith("-") for part in parts):
        raise InvalidSource(
            f"{where} cannot be served by URL: a path component contains '--' or ends with '-';"
            " register it under a name (POST /admin/adapters/register) instead"
        )
    adapter_id = f"{S3_ID_PREFIX}{bucket}/{'--'.join(parts)}"
    try:
        return validate_adapter_id(adapter_id)
    except InvalidAdapterId as e:
        raise InvalidSource(
            f"{where} cannot be served by URL ({e}); register it under a name"
            " (POST /admin/adapters/register) instead"
        ) from None


def read_adapter_files(folder: str) -> tuple[bytes, bytearray]:
    """(adapter_config.json, adapter_model.safetensors) bytes of a PEFT folder; never unpickles."""
    if not os.path.isdir(folder):
        raise AdapterNotFound(f"no adapter directory at {_show(folder)}")
    config_path, weights_path = (os.path.join(folder, f) for f in (CONFIG_FILE, WEIGHTS_FILE))
    if not os.path.isfile(weights_path):
        pickled = sorted(f for f in os.listdir(folder) if f.lower().endswith(PICKLE_SUFFIXES))
        if pickled:
            raise AdapterError(pickle_refusal(_show(folder), pickled))
        raise AdapterError(f"adapter at {_show(folder)} has no {WEIGHTS_FILE}")
    if not os.path.isfile(config_path):
        raise AdapterError(f"adapter at {_show(folder)} has no {CONFIG_FILE}")
    with open(config_path, "rb") as f:
        config_raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(config_raw) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    with open(weights_path, "rb") as f:
        weights = bytearray(os.fstat(f.fileno()).st_size)  # one read into the parse's buffer
        read = f.readinto(weights)
        return config_raw, weights[:read] if read < len(weights) else weights


def resolve_source(
    source: AdapterSource,
    *,
    endpoint: str | None = None,
    token: str | None = None,
    cache_dir: str | None = None,
) -> AdapterFiles:
    """Read a source's files (downloading Hub repos into the HF cache first; S3 folders into
    memory, with the client of adapters.s3.s3_client)."""
    if source.kind == "local":
        config_raw, weights_raw = read_adapter_files(source.path)
        return AdapterFiles(config_raw, weights_raw, source.path, None,
                            read_chat_files(source.path))
    if source.kind == "s3":
        from loragw.adapters.s3 import fetch_s3_folder  # boto3 is only needed for S3 sources

        config_raw, weights_raw, etag, chat = fetch_s3_folder(source.bucket, source.key)
        return AdapterFiles(config_raw, weights_raw, source.uri, etag, chat)
    from loragw.adapters.hub import (
        fetch_hub_adapter,  # huggingface_hub is only needed for Hub sources
    )

    fetched = fetch_hub_adapter(
        source.repo_id, source.revision, endpoint=endpoint, token=token, cache_dir=cache_dir
    )
    config_raw, weights_raw = read_adapter_files(fetched.path)
    return AdapterFiles(config_raw, weights_raw, fetched.source, fetched.revision,
                        read_chat_files(fetched.path))


def read_chat_files(folder: str) -> dict[str, bytes]:
    """The chat files (CHAT_FILES) a folder holds, by name; AdapterError past their size cap."""
    found = {}
    for name in CHAT_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                raw = f.read(MAX_CHAT_FILE_BYTES + 1)
            if len(raw) > MAX_CHAT_FILE_BYTES:
                raise AdapterError(f"{name} of {_show(folder)} is larger than "
                                   f"{MAX_CHAT_FILE_BYTES} bytes")
            found[name] = raw
    return found
