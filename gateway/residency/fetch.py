"""Where this replica gets the bytes of an adapter the fleet's catalog lists, in this order:

    the shared object store  entry.object_key (--adapter-store-url): uploads and path
                             registrations are written through to it
    its source               the Hub at the pinned commit, an s3:// folder, or a local path
                             (a volume every replica mounts at the same path)
    nowhere                  an upload (or an unreadable path) without a shared store: only
                             entry.holder has it, and requests for it are forwarded there

Every byte fetched is checked against the catalog's sha256s before it is parsed, so a
tampered object, a changed path or a moved Hub ref is refused rather than served.
"""

from __future__ import annotations

import hashlib
import os

from adapters.errors import AdapterError
from adapters.object_store import ObjectStore
from adapters.registry import CatalogEntry
from adapters.sources import parse_source, read_adapter_files, resolve_source

UPLOAD_SOURCE = "upload"


class NotHere(AdapterError):
    """This replica cannot get the adapter's bytes; only its holder has them (HTTP 503)."""

    status = 503


class Mismatch(AdapterError):
    """Fetched bytes differ from what the catalog recorded (HTTP 502: the upstream is wrong)."""

    status = 502


def local_path(entry: CatalogEntry) -> str | None:
    """The directory a path registration named, or None for other sources."""
    return entry.source if entry.source.startswith("/") else None


def can_fetch(entry: CatalogEntry, store: ObjectStore | None) -> bool:
    """Whether this replica can get the bytes itself (cheap: no download, no hashing)."""
    if entry.object_key and store is not None:
        return True
    if entry.source.startswith(("hf://", "s3://")):
        return True
    path = local_path(entry)
    return path is not None and os.path.isdir(path)


def fetch_bytes(entry: CatalogEntry, store: ObjectStore | None, *, hub_endpoint: str | None,
                hub_cache_dir: str | None) -> tuple[bytes, bytes]:
    """(adapter_config.json, adapter_model.safetensors) of `entry`, verified. Blocking: run it
    on a worker thread."""
    if entry.object_key and store is not None:
        return store.get(entry.object_key, entry.sha256, entry.config_sha256)
    if entry.source.startswith(("hf://", "s3://")):
        files = resolve_source(parse_source(entry.source, allow_local=False),
                               endpoint=hub_endpoint, cache_dir=hub_cache_dir)
        where = entry.source
        config_raw, weights_raw = files.config_raw, files.weights_raw
    elif local_path(entry) is not None and os.path.isdir(local_path(entry)):
        where = local_path(entry)
        config_raw, weights_raw = read_adapter_files(where)
    else:
        holder = f"replica {entry.holder!r}" if entry.holder else "no replica"
        raise NotHere(f"adapter {entry.adapter_id!r} ({entry.source}) is not in a shared "
                      f"adapter store and {holder} can give its bytes to others; it is served "
                      "where it was registered (start the fleet with --adapter-store-url to "
                      "share uploads)")
    verify(entry, config_raw, weights_raw, where)
    return config_raw, weights_raw


def verify(entry: CatalogEntry, config_raw: bytes, weights_raw: bytes, where: str) -> None:
    for name, raw, expected in (("adapter_model.safetensors", weights_raw, entry.sha256),
                                ("adapter_config.json", config_raw, entry.config_sha256)):
        got = hashlib.sha256(raw).hexdigest()
        if expected and got != expected:
            raise Mismatch(f"{name} of adapter {entry.adapter_id!r} at {where} has sha256 "
                           f"{got[:16]}..., not the catalog's {expected[:16]}... (version "
                           f"{entry.version}): it changed since it was registered; register "
                           "it again to serve the new bytes")
