"""KV-cache blocks: a free list and each sequence's block table."""

from __future__ import annotations

from collections import deque

from engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can hold its first `num_tokens` tokens in the cache."""
        return self.num_missing_blocks(seq, num_tokens) <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        missing = self.num_missing_blocks(seq, num_tokens)
        assert missing <= len(self.free_block_ids), "allocate() without can_allocate()"
        seq.block_table.extend(self.free_block_ids.popleft() for _ in range(missing))

    def free(self, seq: Sequence) -> None:
        self.free_block_ids.extend(seq.block_table)
        seq.block_table.clear()
        seq.num_computed_tokens = 0
        assert len(self.free_block_ids) <= self.num_blocks
