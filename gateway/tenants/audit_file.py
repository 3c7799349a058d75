"""This replica's own copy of the audit trail: JSON lines in `<adapter dir>/.tenants/audit.jsonl`,
each append written and fsynced before the action's answer, so the trail outlives a Redis that
loses its data (audit.py re-publishes from here) or never had it (no --redis-url: this file is
the trail). Bounded: past MAX_FILE_BYTES the file becomes `audit.1.jsonl` (the one before it
dropped) and a new one begins, so at most two files' worth is kept.
"""

from __future__ import annotations

import os

from loragw.adapters.durable_fs import fsync_dir

MAX_FILE_BYTES = 16 << 20  # one generation; two are kept


class AuditFile:
    """Appends and reads raw lines; its owner (AuditLog) serializes the appends."""

    def __init__(self, folder: str, max_bytes: int = MAX_FILE_BYTES):
        self.folder, self.max_bytes = folder, max_bytes
        self.path = os.path.join(folder, "audit.jsonl")
        self.older = os.path.join(folder, "audit.1.jsonl")

    def append(self, line: bytes) -> None:
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line + b"\n")
            os.fsync(fd)
            full = os.fstat(fd).st_size >= self.max_bytes
        finally:
            os.close(fd)
        if full:
            os.replace(self.path, self.older)
            fsync_dir(self.folder)  # the rename survives a crash, or the next append reopens it

    def lines(self) -> list[bytes]:
        """Every line kept, oldest first (a torn last line after a crash included: the
        reader skips what does not decode)."""
        out: list[bytes] = []
        for path in (self.older, self.path):
            try:
                with open(path, "rb") as f:
                    out += f.read().splitlines()
            except FileNotFoundError:
                continue
        return out
