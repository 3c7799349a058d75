"""Where this replica gets the bytes of an adapter the fleet's catalog lists, in this order:

    the shared object store  entry.object_key (--adapter-store-url): uploads and path
                             registrations are written through to it
    its source               the Hub at the pinned commit, an s3:// folder, or a local path
                             (a volume every replica mounts at the same path)
    nowhere                  an upload (or an unreadable path) without a shared store: only
                             entry.holder has it, and requests for it are forwarded there

Every byte fetched is checked against the catalog's sha256s before it is parsed, so a
tampered object, a changed path or a moved Hub ref is refused rather than served. While the
store cannot be reached (`StoreHealth`), the replicas that hold an adapter serve it instead.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from loragw.adapters.errors import AdapterError, StoreUnavailable
from loragw.adapters.object_store import ObjectStore
from loragw.adapters.registry import CatalogEntry
from loragw.adapters.s3 import S3Options
from loragw.adapters.sources import parse_source, read_adapter_files, resolve_source

logger = logging.getLogger(__name__)
UPLOAD_SOURCE = "upload"
STORE_CHECK_S = 5.0  # how long one answer of the store (it answers, or it does not) holds
# A probe gives up fast: while the store is down, requests wait on it before going elsewhere.
PROBE_OPTIONS = S3Options(connect_timeout_s=1.0, read_timeout_s=2.0, max_attempts=1)


class NotHere(AdapterError):
    """This replica cannot get the adapter's bytes; only its holder has them (HTTP 503)."""

    status = 503
    code = "adapter_unavailable"  # as the router answers when no holder does


class Mismatch(AdapterError):
    """Fetched bytes differ from what the catalog recorded (HTTP 502: the upstream is wrong)."""

    status = 502


def local_path(entry: CatalogEntry) -> str | None:
    """The directory a path registration named, or None for other sources."""
    return entry.source if entry.source.startswith("/") else None


def in_store(entry: CatalogEntry, store: ObjectStore | None) -> bool:
    """Whether the bytes come from the shared object store."""
    return bool(entry.object_key) and store is not None


def can_fetch(entry: CatalogEntry, store: ObjectStore | None) -> bool:
    """Whether this replica can get the bytes itself (cheap: no download, no hashing)."""
    if in_store(entry, store):
        return True
    if entry.source.startswith(("hf://", "s3://")):
        return True
    path = local_path(entry)
    return path is not None and os.path.isdir(path)


def fetch_bytes(entry: CatalogEntry, store: ObjectStore | None, *, hub_endpoint: str | None,
                hub_cache_dir: str | None) -> tuple[bytes, bytes]:
    """(adapter_config.json, adapter_model.safetensors) of `entry`, verified. Blocking: run it
    on a worker thread."""
    if in_store(entry, store):
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


async def check_store(store: ObjectStore | None, shared: bool) -> None:
    """At start: the shared object store answers; or, in a fleet without one, say what that
    means."""
    if store is not None:
        await asyncio.to_thread(store.check)
    elif shared:
        logger.warning("--redis-url without --adapter-store-url: uploads and paths other "
                       "replicas cannot read stay on the replica that took them (requests "
                       "for them are forwarded there)")


def verify(entry: CatalogEntry, config_raw: bytes, weights_raw: bytes, where: str) -> None:
    for name, raw, expected in (("adapter_model.safetensors", weights_raw, entry.sha256),
                                ("adapter_config.json", config_raw, entry.config_sha256)):
        got = hashlib.sha256(raw).hexdigest()
        if expected and got != expected:
            raise Mismatch(f"{name} of adapter {entry.adapter_id!r} at {where} has sha256 "
                           f"{got[:16]}..., not the catalog's {expected[:16]}... (version "
                           f"{entry.version}): it changed since it was registered; register "
                           "it again to serve the new bytes")


class StoreHealth:
    """Whether the shared object store (None: there is none) answers now: one HEAD of its bucket
    at most every STORE_CHECK_S, through a client that gives up fast, and down at once when a
    fetch finds it unreachable. The residency manager asks before it promises to fetch an
    adapter here that other replicas hold."""

    def __init__(self, url: str | None):
        self.probe_store = ObjectStore(url, options=PROBE_OPTIONS) if url else None
        self.up, self.checked_at = True, -math.inf
        self._lock = asyncio.Lock()  # a burst of requests waits on one probe

    async def reachable(self) -> bool:
        async with self._lock:
            if self.probe_store and time.monotonic() - self.checked_at >= STORE_CHECK_S:
                try:
                    await asyncio.to_thread(self.probe_store.check)
                    self.up = True
                except StoreUnavailable:
                    self.up = False
                except AdapterError:  # it answers (refusing us, say): its fetch will say why
                    self.up = True
                self.checked_at = time.monotonic()
        return self.up

    @contextmanager
    def watching(self) -> Iterator[None]:
        """A fetch inside that finds the store unreachable marks it down for STORE_CHECK_S."""
        try:
            yield
        except StoreUnavailable:
            self.up, self.checked_at = False, time.monotonic()
            raise
