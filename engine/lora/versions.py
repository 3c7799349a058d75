"""A sequence runs on the adapter version it started on, to its end.

Replacing an adapter (`LoRAManager.add` of a registered name) makes new sequences take the new
weights at once. A sequence that already ran on the old ones keeps them: while it holds its
slot, that slot drains (stale); if it is preempted and admitted again, it must not come back on
the new weights mid-answer. So the replaced version's RegisteredAdapter is kept here, with its
host copy, until the last sequence that started on it finishes.
"""

from __future__ import annotations

from collections import Counter

from loragw.engine.lora.state import RegisteredAdapter
from loragw.engine.request.sequence import Sequence


class StartedVersions:
    def __init__(self) -> None:
        self.started: Counter[tuple[str, int]] = Counter()  # unfinished sequences per version
        self.retired: dict[tuple[str, int], RegisteredAdapter] = {}  # replaced, still in use

    def entry_for(self, seq: Sequence, current: RegisteredAdapter | None
                  ) -> RegisteredAdapter | None:
        """The weights `seq` runs on: the version it started on, else the current one."""
        if current is not None and seq.adapter_version in (0, current.version):
            return current
        return self.retired.get((seq.adapter, seq.adapter_version))

    def start(self, seq: Sequence, entry: RegisteredAdapter) -> None:
        """`seq` got a slot: the first time, it is bound to `entry`'s version."""
        if not seq.adapter_version:
            seq.adapter_version = entry.version
            self.started[seq.adapter, entry.version] += 1

    def replaced(self, name: str, previous: RegisteredAdapter) -> None:
        """`name` got new weights: keep the old ones while sequences that started on them run."""
        if self.started[name, previous.version]:
            self.retired[name, previous.version] = previous

    def finished(self, seq: Sequence) -> None:
        key = (seq.adapter, seq.adapter_version)
        if seq.adapter is None or not seq.adapter_version:
            return
        self.started[key] -= 1
        if self.started[key] <= 0:
            del self.started[key]
            self.retired.pop(key, None)
