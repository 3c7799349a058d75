"""Filesystem steps that survive a crash: a write is on disk before it returns, and a rename is
on disk once its folder is fsynced. The store (adapters.store) builds its atomic puts from these.
"""

from __future__ import annotations

import ctypes
import errno
import os

__all__ = ["write_synced", "fsync_dir", "exchange"]


def write_synced(path: str, data: bytes) -> None:
    """Create path (never overwrite) holding data, fsynced; its folder still needs fsync_dir."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    """Persist the folder's entries: the renames, creations and removals made in it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)
if _renameat2 is not None:
    _renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]


def exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)
