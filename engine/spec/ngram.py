"""Prompt lookup: propose the tokens that followed the last time the request's latest n tokens
appeared in its own prompt or output (vLLM's "ngram" method), no model needed.

For n from `max_n` down to `min_n`, the latest earlier occurrence of the request's last n tokens
wins; its next k tokens are the proposal. A request's tokens live in a growing NumPy array,
appended to as it decodes, so a step costs a few vectorised compares per row, not a copy of
its history.
"""

from __future__ import annotations

import numpy as np

from loragw.engine.request.sequence import Sequence


class TokenHistory:
    """One request's token ids as a NumPy array that grows by doubling."""

    __slots__ = ("array", "length")

    def __init__(self, tokens: list[int]):
        self.array = np.zeros(max(64, 2 * len(tokens)), dtype=np.int64)
        self.length = 0
        self.sync(tokens)

    def sync(self, tokens: list[int]) -> np.ndarray:
        """Append what `tokens` has beyond this copy; returns the valid view."""
        n = len(tokens)
        if n > self.length:
            if n > len(self.array):
                grown = np.zeros(2 * n, dtype=np.int64)
                grown[:self.length] = self.array[:self.length]
                self.array = grown
            self.array[self.length:n] = tokens[self.length:n]
            self.length = n
        return self.array[:n]


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` (n in [min_n, max_n]) that occurred before; [] when none did."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # candidate starts i < length - n whose window tokens[i:i+n] == suffix: filter on the
        # first token, then compare the rest only there
        starts = np.flatnonzero(tokens[:length - n] == suffix[0])
        for offset in range(1, n):
            if not len(starts):
                break
            starts = starts[tokens[starts + offset] == suffix[offset]]
        if len(starts):
            follow = starts[-1] + n
            return tokens[follow:follow + k].tolist()
    return []


NO_DRAFT_MODEL = ("draft adapters need speculative decoding with a draft model "
                  '(--speculative-config {"method": "draft_model", ...})')


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.histories: dict[int, TokenHistory] = {}  # seq_id -> its tokens

    def propose(self, seqs: list[Sequence], ks: list[int],
                sampler: object = None) -> list[tuple[list[int], None]]:
        """Up to ks[j] tokens that followed the latest earlier occurrence of seqs[j]'s last
        n-gram (no distribution: they are looked up, not sampled)."""
        return [(self.lookup(seq, k), None) for seq, k in zip(seqs, ks, strict=True)]

    def free_drafts(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """The same lookups: they cost no model step."""
        return [self.lookup(seq, k) for seq, k in zip(seqs, ks, strict=True)]

    def lookup(self, seq: Sequence, k: int) -> list[int]:
        history = self.histories.get(seq.seq_id)
        if history is None:
            history = self.histories[seq.seq_id] = TokenHistory(seq.token_ids)
        return lookup(history.sync(seq.token_ids), self.min_n, self.max_n, k)

    def forget(self, seq_id: int) -> None:
        """Drop a finished or aborted request's copy."""
        self.histories.pop(seq_id, None)

    def forget_all_but(self, alive: set[int]) -> None:
        """Drop the copies of finished, aborted and preempted requests."""
        if len(self.histories) > len(alive):
            for seq_id in [i for i in self.histories if i not in alive]:
                del self.histories[seq_id]

    def add_adapter(self, name: str, path: str) -> None:
        raise ValueError(NO_DRAFT_MODEL)

    def close(self) -> None:
        self.histories.clear()
