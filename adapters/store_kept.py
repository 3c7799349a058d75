"""Earlier versions of each adapter, kept on disk so a request may pin one (`bot@3`).

Layout, beside the store's newest copies::

    root/.kept/<id>/<version>/   adapter_config.json, adapter_model.safetensors, meta.json

A replace moves the copy it supersedes here (the store's lock held) and keeps the newest
`versions_kept - 1` of them; a delete of the id removes them all. A replica that serves a pinned
version it never stored fetches it here too (put). Nothing here is the fleet's truth: the
catalog entry's `kept` says which versions exist; this folder is one replica's copies of them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile

from loragw.adapters.durable_fs import fsync_dir, write_synced
from loragw.adapters.ids import validate_adapter_id
from loragw.adapters.safetensors_check import CONFIG_FILE, WEIGHTS_FILE
from loragw.adapters.store_meta import META_FILE, StoredAdapter, encode_meta, read_meta

logger = logging.getLogger(__name__)

KEPT_DIR = ".kept"


class KeptVersions:
    def __init__(self, root: str, versions_kept: int) -> None:
        if versions_kept < 1:
            raise ValueError(f"--adapter-versions-kept must be >= 1, got {versions_kept}")
        self.folder, self.versions_kept = os.path.join(root, KEPT_DIR), versions_kept

    def path(self, adapter_id: str, version: int) -> str:
        return os.path.join(self.folder, *validate_adapter_id(adapter_id).split("/"), str(version))

    def get(self, adapter_id: str, version: int) -> StoredAdapter | None:
        stored = read_meta(self.path(adapter_id, version), adapter_id)
        return stored if stored is not None and stored.version == version else None

    def versions(self, adapter_id: str) -> list[int]:
        """The versions of `adapter_id` kept here, newest first."""
        try:
            names = os.listdir(os.path.dirname(self.path(adapter_id, 0)))
        except OSError:
            return []
        return sorted((int(n) for n in names if n.isdigit()), reverse=True)

    def keep(self, old_copy: str, old: StoredAdapter) -> None:
        """Move a superseded copy (a folder of the store's) here; drop the oldest beyond the
        limit. Only called after a replace committed: failures are logged, never raised."""
        try:
            if self.versions_kept > 1:
                target = self.path(old.adapter_id, old.version)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.rmtree(target, ignore_errors=True)
                os.rename(old_copy, target)
            self.prune(old.adapter_id)
        except OSError as e:
            logger.warning("could not keep %s v%d: %s", old.adapter_id, old.version, e)

    def put(self, stored: StoredAdapter, config_raw: bytes, weights_raw: bytes) -> StoredAdapter:
        """A version fetched to serve a pin, written whole before it becomes visible."""
        target = self.path(stored.adapter_id, stored.version)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(target))
        try:
            write_synced(os.path.join(tmp, CONFIG_FILE), config_raw)
            write_synced(os.path.join(tmp, WEIGHTS_FILE), weights_raw)
            write_synced(os.path.join(tmp, META_FILE), encode_meta(stored))
            fsync_dir(tmp)
            shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return read_meta(target, stored.adapter_id)

    def prune(self, adapter_id: str, keep: set[int] | None = None) -> list[int]:
        """Drop the versions beyond the newest `versions_kept - 1` (or, given `keep`, every
        version not in it); returns the versions dropped."""
        versions = self.versions(adapter_id)
        dropped = ([v for v in versions if v not in keep] if keep is not None
                   else versions[self.versions_kept - 1:])
        for version in dropped:
            shutil.rmtree(self.path(adapter_id, version), ignore_errors=True)
            logger.info("dropped kept version %s v%d", adapter_id, version)
        self._tidy(adapter_id)
        return dropped

    def drop(self, adapter_id: str) -> None:
        """Every kept version of `adapter_id` (the id was deleted)."""
        shutil.rmtree(os.path.dirname(self.path(adapter_id, 0)), ignore_errors=True)
        self._tidy(adapter_id)

    def _tidy(self, adapter_id: str) -> None:
        """Empty id and org folders go, so a listing of .kept shows only what is kept."""
        folder = os.path.dirname(self.path(adapter_id, 0))
        while folder != self.folder:
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only if empty
            folder = os.path.dirname(folder)
