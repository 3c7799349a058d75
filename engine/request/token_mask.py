"""A step's grammar masks as the sampler applies them: which rows are constrained, their
allowed tokens as packed bitmasks (xgrammar's layout, 32 tokens a word) and the -inf bias of the
rest, and the bitmask arithmetic (engine/request/structured.py fills them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import Tensor

try:
    import xgrammar as xgr
except ImportError:  # only structured output needs it (engine/request/structured.py)
    xgr = None


@dataclass(slots=True)
class TokenMask:
    """Allowed tokens for some rows of a sampling batch: row j is for logits row rows[j].

    bitmask: [R, ceil(V / 32)] int32, bit b of word w allows token 32 * w + b (xgrammar's
    layout). bias: [R, V] float32, 0 where allowed and -inf elsewhere, built on the mask thread
    for CPU logits: adding it is ~10x cheaper than a masked_fill on the main thread."""

    bitmask: Tensor
    rows: list[int]
    bias: Tensor

    def split(self, n: int) -> tuple[TokenMask | None, TokenMask | None]:
        """The masks of rows [0, n) and of rows n.. (renumbered from 0); None where none."""
        first = [j for j, row in enumerate(self.rows) if row < n]
        rest = [j for j, row in enumerate(self.rows) if row >= n]
        return (self._take(first, 0), self._take(rest, n))

    def _take(self, entries: list[int], shift: int) -> TokenMask | None:
        if not entries:
            return None
        if len(entries) == len(self.rows) and not shift:
            return self
        return TokenMask(self.bitmask[entries], [self.rows[j] - shift for j in entries],
                         self.bias[entries])

    def apply(self, logits: Tensor) -> Tensor:
        """logits: [B, V] -> a copy with disallowed tokens of the masked rows at -inf."""
        if logits.device.type != "cpu":  # xgrammar's kernel, on the accelerator
            rows = logits[self.rows]
            xgr.apply_token_bitmask_inplace(rows, self.bitmask.to(logits.device))
            logits = logits.clone()
            logits[self.rows] = rows
            return logits
        if len(self.rows) == logits.shape[0]:  # every row constrained: no gather/scatter
            return logits + self.bias  # x + 0.0 == x exactly, x + -inf == -inf
        logits = logits.clone()
        logits[self.rows] += self.bias
        return logits


def pack_bitmask(allowed: list[bool], vocab_size: int) -> np.ndarray:
    """Per-token flags (tokens past the list are allowed) -> [ceil(vocab_size / 32)] int32."""
    flags = np.ones(-(-vocab_size // 32) * 32, dtype=np.uint32)
    flags[: len(allowed)] = allowed
    return (flags.reshape(-1, 32) << np.arange(32, dtype=np.uint32)).sum(-1, dtype=np.uint32) \
        .view(np.int32)


def mask_bias(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """[R, W] int32 packed allowed-bits -> [R, vocab_size] float32 of 0 (allowed) / -inf.

    One table lookup per byte (8 tokens), ~4x cheaper than unpacking bits with shifts. NumPy,
    not torch, because it runs on the mask thread: a torch op there big enough to go parallel
    starts a second OpenMP team, whose spinning threads then slow every forward pass."""
    bias = np.take(_BYTE_BIAS, bitmask.view(np.uint8), axis=0)  # [R, 4W, 8], little-endian
    return bias.reshape(len(bitmask), -1)[:, :vocab_size]


# _BYTE_BIAS[byte, b]: 0 if bit b of byte is set (token allowed), else -inf.
_BYTE_BIAS = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, 0, -np.inf) \
    .astype(np.float32)
