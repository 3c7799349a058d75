"""The disk tier: registered adapters under --adapter-dir, known again after a restart.

Layout (ids are NAME or ORG/NAME, see adapters.ids; names starting with '.' are the store's)::

    root/.lock                    flock held by every change and by start-up recovery
    root/.versions.json           last version of each deleted id, so a version never repeats
    root/<id>/adapter_config.json, adapter_model.safetensors, meta.json (adapters.store_meta)
    root/.kept/<id>/<version>/    earlier versions a request may pin (adapters.store_kept)
    root/.tmp-*  .old-*  .del-*   a change in flight; recovered at start (see _recover)

A put writes a complete copy into root/.tmp-*, fsyncs every file and the directory (see
adapters.durable_fs), then makes it visible with one rename (or, replacing, one atomic exchange
with the old copy; where the filesystem cannot exchange, the old copy is renamed to .old-* first
and restored at start if the process died in between). Before that last step a failure leaves
the tree as it was; after it, nothing is raised (the superseded copy goes to .kept). The store
does not validate adapters: callers run adapters.format.parse_adapter first.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import threading
import time

from loragw.adapters.base_identity import BaseIdentity
from loragw.adapters.durable_fs import exchange, fsync_dir, write_synced
from loragw.adapters.errors import AdapterError, AdapterNotFound, InvalidAdapterId
from loragw.adapters.ids import validate_adapter_id
from loragw.adapters.safetensors_check import CONFIG_FILE, WEIGHTS_FILE
from loragw.adapters.store_kept import KeptVersions
from loragw.adapters.store_meta import META_FILE, StoredAdapter, StoredMeta, encode_meta, read_meta
from loragw.adapters.types import FileDigests

logger = logging.getLogger(__name__)

VERSIONS_FILE = ".versions.json"
TMP, OLD, DEL = ".tmp-", ".old-", ".del-"


class AdapterExists(AdapterError):
    """The id is taken and the request did not ask to replace it (HTTP 409)."""

    status = 409
    code = "adapter_exists"


class AdapterStore:
    """`AdapterStore(root, base)`: the adapters of one base model (every put records `base`;
    None: a store that records none, e.g. one written before adapters were keyed by base)."""

    def __init__(self, root: str | os.PathLike, base: BaseIdentity | None = None,
                 versions_kept: int = 1) -> None:
        os.makedirs(root, exist_ok=True)
        self.root, self.base, self.kept = os.path.realpath(root), base, KeptVersions(
            os.path.realpath(root), versions_kept)  # kept: earlier versions, for pins
        self._thread_lock = threading.Lock()
        self._lock_fd = os.open(os.path.join(self.root, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        with self._locked():
            self._recover()

    def close(self) -> None:
        os.close(self._lock_fd)

    def path(self, adapter_id: str) -> str:
        """Folder of adapter_id's files (existing or not); never outside root."""
        path = os.path.join(self.root, *validate_adapter_id(adapter_id).split("/"))
        if os.path.commonpath([self.root, os.path.realpath(path)]) != self.root:
            raise InvalidAdapterId(f"adapter id {adapter_id!r} leads outside {self.root} through"
                                   " a symbolic link there; remove the link")  # fmt: skip
        return path

    def get(self, adapter_id: str) -> StoredAdapter | None:
        return read_meta(self.path(adapter_id), adapter_id)

    def list(self) -> list[StoredAdapter]:
        found = []
        for name in _entries(self.root):
            meta = read_meta(os.path.join(self.root, name), name)
            if meta is not None:
                found.append(meta)
                continue
            for sub in _entries(os.path.join(self.root, name)):
                meta = read_meta(os.path.join(self.root, name, sub), f"{name}/{sub}")
                found.extend([meta] if meta else [])
        return sorted(found, key=lambda m: m.adapter_id)

    def put(
        self,
        adapter_id: str,
        config_raw: bytes,
        weights_raw: bytes,
        meta: StoredMeta,
        replace: bool = False,
        digests: FileDigests | None = None,  # the files' sha256s, where the caller has them
    ) -> StoredAdapter:
        digests = digests or FileDigests.of(config_raw, weights_raw)
        target = self.path(adapter_id)
        with self._locked():
            old = self.get(adapter_id)
            if old is not None and not replace:
                raise AdapterExists(f"adapter {adapter_id!r} already exists (version {old.version}); "
                                    "delete it first or replace it (vLLM: load again; admin "
                                    "API: replace=true)")  # fmt: skip
            self._check_namespace(adapter_id, target, old)
            version = meta.version or self.next_version(adapter_id)
            stored = StoredAdapter(
                adapter_id, version, digests.weights, len(weights_raw), meta.source, meta.revision,
                meta.rank, tuple(meta.targets), time.time(), target, digests.config,
                meta.object_key, tuple(meta.warnings), meta.owner, self.base, meta.draft_source,
                meta.chat)  # fmt: skip
            parent = os.path.dirname(target)
            made_parent = not os.path.isdir(parent)
            tmp = tempfile.mkdtemp(prefix=TMP, dir=self.root)
            try:
                write_synced(os.path.join(tmp, CONFIG_FILE), config_raw)
                write_synced(os.path.join(tmp, WEIGHTS_FILE), weights_raw)
                write_synced(os.path.join(tmp, META_FILE), encode_meta(stored))
                fsync_dir(tmp)
                if made_parent:
                    os.makedirs(parent)
                    fsync_dir(self.root)
                self._commit(tmp, target, old)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                if made_parent:
                    with contextlib.suppress(OSError):
                        os.rmdir(parent)
                raise
        logger.info("stored adapter %s version %d (%d bytes)", adapter_id, version, len(weights_raw))
        return stored

    def next_version(self, adapter_id: str) -> int:
        """The version a put of `adapter_id` gets by default: one past any it ever had here."""
        old = self.get(adapter_id)
        return max(old.version if old else 0, self._versions().get(adapter_id, 0)) + 1

    def delete(self, adapter_id: str) -> StoredAdapter:
        target = self.path(adapter_id)
        with self._locked():
            old = self.get(adapter_id)
            if old is None:
                raise AdapterNotFound(f"adapter {adapter_id!r} is not registered")
            versions = self._versions()
            versions[adapter_id] = max(old.version, versions.get(adapter_id, 0))
            self._write_versions(versions)
            trash = tempfile.mkdtemp(prefix=DEL, dir=self.root)
            try:
                os.rename(target, os.path.join(trash, "x"))
            except BaseException:
                os.rmdir(trash)
                raise
            with contextlib.suppress(OSError):
                fsync_dir(os.path.dirname(target))
            self._tidy(trash, os.path.dirname(target))
            self.kept.drop(adapter_id)
        logger.info("deleted adapter %s version %d", adapter_id, old.version)
        return old

    def supersede(self, adapter_id: str) -> None:
        """This disk's copy is no longer the newest version: it becomes a kept one (or goes)."""
        with self._locked():
            old = self.get(adapter_id)
            if old is None:
                return
            trash = tempfile.mkdtemp(prefix=DEL, dir=self.root)
            os.rename(self.path(adapter_id), os.path.join(trash, "x"))
            self.kept.keep(os.path.join(trash, "x"), old)
            self._tidy(trash, os.path.dirname(self.path(adapter_id)))

    # -- internals -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self):
        with self._thread_lock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _check_namespace(self, adapter_id: str, target: str, old: StoredAdapter | None) -> None:
        """NAME and NAME/X cannot both be adapters: one's folder would hold the other's."""
        if "/" in adapter_id:
            org = adapter_id.split("/")[0]
            if read_meta(os.path.join(self.root, org), org) is not None:
                raise AdapterExists(f"adapter id {adapter_id!r} is under adapter {org!r}; "
                                    f"'{org}/...' ids cannot be used while {org!r} exists")  # fmt: skip
        elif old is None and os.path.isdir(target) and any(_entries(target)):
            raise AdapterExists(f"adapter id {adapter_id!r} is taken by adapters named "
                                f"'{adapter_id}/...'; choose another id")  # fmt: skip

    def _commit(self, tmp: str, target: str, old: StoredAdapter | None) -> None:
        """Make tmp's content visible at target in one step; after it, only log failures."""
        parent = os.path.dirname(target)
        if not os.path.lexists(target):
            os.rename(tmp, target)
            leftover = None
        elif exchange(tmp, target):
            leftover = tmp  # now holds the old copy
        else:  # no atomic exchange here: park the old copy where _recover can restore it
            leftover = tempfile.mkdtemp(prefix=OLD, dir=self.root)
            parked = os.path.join(leftover, "x")
            try:
                os.rename(target, parked)
                try:
                    os.rename(tmp, target)
                except BaseException:
                    os.rename(parked, target)
                    raise
            except BaseException:
                with contextlib.suppress(OSError):  # not empty: _recover puts the old copy back
                    os.rmdir(leftover)
                raise
        try:
            fsync_dir(parent)
            if parent != self.root:
                fsync_dir(self.root)
        except OSError as e:
            logger.warning("adapter stored, but fsync of %s failed: %s", parent, e)
        if leftover is not None:
            if old is not None:  # the superseded copy: kept for pins (or dropped) by self.kept
                self.kept.keep(leftover if leftover == tmp else os.path.join(leftover, "x"), old)
            if os.path.lexists(leftover):
                self._tidy(leftover, None)

    def _tidy(self, trash: str, parent: str | None) -> None:
        try:
            shutil.rmtree(trash)
            if parent and parent != self.root and not os.listdir(parent):
                os.rmdir(parent)
        except OSError as e:  # _recover finishes the job at the next start
            logger.warning("could not remove %s: %s", trash, e)

    def _recover(self) -> None:
        """Finish or undo changes a crash interrupted: a .tmp-* never became visible (or holds
        an exchanged-out old copy), a .del-* was deleted, an .old-* is restored only if its
        replacement never arrived."""
        for name in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, name)
            if name.startswith(OLD) and os.path.isdir(path):
                parked = os.path.join(path, "x")
                meta = read_meta(parked, None)
                target = self._path_or_none(meta.adapter_id) if meta else None
                if target is not None and not os.path.lexists(target):
                    logger.warning("restoring %s after an interrupted replace", meta.adapter_id)
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    os.rename(parked, target)
            if name.startswith((TMP, OLD, DEL)) or name == VERSIONS_FILE + ".tmp":
                logger.info("removing %s left by an interrupted change", name)
                (shutil.rmtree if os.path.isdir(path) else os.unlink)(path)
        for name in _entries(self.root):  # org folders emptied by an interrupted delete
            with contextlib.suppress(OSError):
                if not os.listdir(os.path.join(self.root, name)):
                    os.rmdir(os.path.join(self.root, name))
        fsync_dir(self.root)

    def _path_or_none(self, adapter_id: str) -> str | None:
        try:
            return self.path(adapter_id)
        except InvalidAdapterId:
            return None

    def _versions(self) -> dict[str, int]:
        try:
            with open(os.path.join(self.root, VERSIONS_FILE), "rb") as f:
                return json.load(f)
        except FileNotFoundError:
            return {}
        except ValueError as e:  # versions then restart from the stored ones
            logger.warning("ignoring unreadable %s: %s", VERSIONS_FILE, e)
            return {}

    def _write_versions(self, versions: dict[str, int]) -> None:
        path = os.path.join(self.root, VERSIONS_FILE)
        write_synced(path + ".tmp", json.dumps(versions, sort_keys=True).encode())
        os.replace(path + ".tmp", path)
        fsync_dir(self.root)


def _entries(folder: str) -> list[str]:
    """Sub-folders named like an id component (so not the store's dot-names, nor a mount's
    lost+found): adapters, or orgs holding adapters."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(n for n in names if _is_component(n) and os.path.isdir(os.path.join(folder, n)))


def _is_component(name: str) -> bool:
    try:
        return "/" not in validate_adapter_id(name)
    except InvalidAdapterId:
        return False
