"""KV-cache blocks: ref-counted blocks, a free list, the prefix cache, each sequence's table.

A block is referenced (ref_count > 0) while some sequence's block table holds it; with prefix
caching several sequences may hold the same full block. Unreferenced blocks are free: truly
free ones (no content worth keeping) and cached ones (full, hashed, in the prefix cache's LRU).
Allocation takes truly free blocks first, then evicts the least recently freed cached one.
`num_free_blocks` counts both kinds, so `num_used_blocks == 0` means no block is referenced.

A block joins the prefix cache when it is allocated for a step that will fill it, not after
that step ran (as vLLM V1 does): requests admitted in the same step then share it at once,
which matters most for a burst of requests with one system prompt. That is sound because each
layer writes every row's new K/V into the cache before any row's attention reads it. If the
step fails, `rollback()` drops the blocks it registered: their K/V were never written.

Sliding window (`window`: set when every layer of the model attends to at most the last
`window` keys). Before a step, a sequence's leading blocks that lie wholly before the window of
its next query (position num_computed_tokens, which sees keys > position - window) are handed
back, so a decoding sequence holds about window / block_size + 1 blocks however long it gets.
Their table entries then name `pad_block` (the model runner's padding block, never handed out)
so that positions still index the table; attention masks those keys out and never uses them.
A handed-back block is released like any other: one in the prefix cache stays there (its K/V
are still right for its prefix, whoever shares it next) until evicted; a sequence that matches
a cached prefix takes references only on the matched blocks its window still needs. So a
sequence never holds more than `peak_blocks` at once: its window plus one step's chunk (at
most `max_chunk` tokens, the scheduler's budget), which is what a request must fit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Ids

from loragw.engine.kv.prefix_cache import Block, PrefixCache, block_hash
from loragw.engine.request.checks import peak_blocks
from loragw.engine.request.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None, max_chunk: int | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window  # every layer's widest sliding window; None: some layer sees all
        self.max_chunk = max_chunk  # most tokens one step computes for one sequence (None: any)
        self.pad_block = num_blocks  # what a handed-back table entry names (never handed out)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # unreferenced, unhashed
        self.cache = PrefixCache()
        self.registered_this_step: list[Block] = []  # filled by this step; see rollback()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.cache.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def peak_blocks(self, num_tokens: int) -> int:
        return peak_blocks(num_tokens, self.block_size, self.window, self.max_chunk)

    def _window_start(self, num_computed: int) -> int:
        """Index of the first block the query at position num_computed reads (0 without a
        window): the blocks before it lie wholly before p - window + 1."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // self.block_size

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    # ---- prefix matching --------------------------------------------------------------------
    def match(self, seq: Sequence) -> list[int]:
        """Ids of the cached blocks holding the longest run of `seq`'s leading full blocks under
        `seq.cache_key`; changes nothing. At most (num_tokens - 1) // block_size blocks: at least
        one token is left to compute, so the step yields logits, and its K/V go to a block of
        the sequence's own, never into a shared one. A sequence still to compute prompt
        logprobs matches nothing: those come from the prefill's own logits, never the cache."""
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []
        hit: list[int] = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block = self.cache.get(self._hash(seq, i))
            if block is None:
                break
            hit.append(block.block_id)
        return hit

    def _hash(self, seq: Sequence, index: int) -> bytes:
        """The hash of `seq`'s full block `index`, chained from its earlier ones (memoised)."""
        hashes, size = seq.block_hashes, self.block_size
        while len(hashes) <= index:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else None,
                                     seq.token_ids[i * size:(i + 1) * size], seq.cache_key))
        return hashes[index]

    # ---- allocation -------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_tokens: int, cached: Ids[int] = ()) -> bool:
        """Whether `seq` can hold its first `num_tokens` tokens, sharing `cached` (from match())
        as its first blocks. A cached block nobody references leaves the free pool when shared."""
        kept = cached[self._window_start(len(cached) * self.block_size):]  # what _share takes
        revived = sum(self.blocks[b].ref_count == 0 for b in kept)
        missing = max(0, self.blocks_for(num_tokens) - len(seq.block_table) - len(cached))
        return missing + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int, cached: Ids[int] = ()) -> None:
        """Give `seq` blocks for its first `num_tokens` tokens. On admission (an empty block
        table) it first shares `cached`, whose tokens then count as computed."""
        assert self.can_allocate(seq, num_tokens, cached), "allocate() without can_allocate()"
        if not seq.block_table:
            self._share(seq, cached)
        else:
            assert not cached, "a running sequence matched its prefix again"
        self._drop_out_of_window(seq)
        for _ in range(self.num_missing_blocks(seq, num_tokens)):
            seq.block_table.append(self._take().block_id)
        if self.enable_prefix_caching:
            self._register_filled(seq, num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """can_allocate + allocate for a running sequence (no prefix to share), in one pass:
        False, changing nothing (but handing back blocks before its window), when the free
        blocks do not cover it. Every running sequence
        takes this path every step, most often needing no block at all."""
        if self.window is not None:  # first, so that the blocks it frees can serve the step
            self._drop_out_of_window(seq)
        missing = self.blocks_for(num_tokens) - len(seq.block_table)
        if missing > 0:
            if missing > self.num_free_blocks:
                return False
            for _ in range(missing):
                seq.block_table.append(self._take().block_id)
        # (a decode step fills a block once every block_size steps: the test saves the call)
        if self.enable_prefix_caching and (num_tokens // self.block_size
                                           > seq.num_computed_tokens // self.block_size):
            self._register_filled(seq, num_tokens)
        return True

    def _drop_out_of_window(self, seq: Sequence) -> None:
        """Hand back `seq`'s blocks that lie wholly before its next query's window."""
        if self.window is None:
            return
        start, table = self._window_start(seq.num_computed_tokens), seq.block_table
        for i in range(seq.num_dropped_blocks, start):
            self._release(table[i])
            table[i] = self.pad_block
        seq.num_dropped_blocks = max(seq.num_dropped_blocks, start)

    def _release(self, block_id: int) -> None:
        """Drop one reference; an unreferenced block goes to the prefix cache's LRU if hashed,
        else to the free list."""
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed more often than taken"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self.cache.park(block)
            else:
                self.free_block_ids.append(block_id)

    def _register_filled(self, seq: Sequence, num_tokens: int) -> None:
        """Put the blocks this step's tokens will fill in the prefix cache (module docstring);
        never one that drafts fill (speculative decoding): a draft may yet be rejected, nor one
        whose last token is not read back yet (`settle_pending` registers that one)."""
        num_tokens = min(num_tokens, seq.num_tokens - seq.pending)
        for i in range(seq.num_computed_tokens // self.block_size, num_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            if self.cache.register(block, self._hash(seq, i)):
                self.registered_this_step.append(block)

    def _share(self, seq: Sequence, cached: Ids[int]) -> None:
        """Take the matched blocks; under a window only those its next query reads (the
        others stay where they are, their table entries naming the padding block)."""
        skip = self._window_start(len(cached) * self.block_size)
        for block_id in cached[skip:]:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.cache.revive(block)
            block.ref_count += 1
        seq.block_table.extend([self.pad_block] * skip + list(cached[skip:]))
        seq.num_dropped_blocks = skip
        seq.num_computed_tokens = len(cached) * self.block_size
        if seq.num_cached_tokens is None:  # the first admission; a preempted one re-matches
            seq.num_cached_tokens = seq.num_computed_tokens
        if self.enable_prefix_caching:
            self.cache.stats.queries += seq.num_tokens
            self.cache.stats.hits += seq.num_computed_tokens

    def _take(self) -> Block:
        block = (self.blocks[self.free_block_ids.popleft()] if self.free_block_ids
                 else self.cache.evict())
        assert block.ref_count == 0 and block.hash is None
        block.ref_count = 1
        return block

    def settle_verified(self, seq: Sequence, num_kept: int) -> None:
        """A step that verified `seq`'s drafts kept the K/V of its last token and `num_kept`
        drafts, now in seq.token_ids: the blocks they filled join the prefix cache, and the
        blocks only rejected drafts reached go back to the free list."""
        start = seq.num_computed_tokens
        seq.num_computed_tokens += 1 + num_kept
        if self.enable_prefix_caching:  # their K/V were written: no rollback to track
            for i in range(start // self.block_size, seq.num_computed_tokens // self.block_size):
                self.cache.register(self.blocks[seq.block_table[i]], self._hash(seq, i))
        self.trim(seq, seq.num_tokens)

    def settle_pending(self, seq: Sequence) -> None:
        """`seq`'s last token, a placeholder when this step registered its blocks, is known
        now: if it completes a block whose K/V a launched step computes, that block joins the
        prefix cache (async scheduling; a sequence not in that step registers it when it is)."""
        last = seq.num_tokens - 1
        if (self.enable_prefix_caching and (last + 1) % self.block_size == 0
                and last < seq.num_computed_tokens):
            index = last // self.block_size
            self.cache.register(self.blocks[seq.block_table[index]], self._hash(seq, index))

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Hand back `seq`'s blocks past its first `num_tokens` tokens (never cached ones: a
        block is cached only once its tokens are the sequence's own)."""
        while len(seq.block_table) > self.blocks_for(num_tokens):
            self._release(seq.block_table.pop())

    def commit(self, seqs: list[Sequence], num_new: list[int]) -> None:
        """The step ran: the blocks it registered hold their K/V now, and so does each row's
        cache for its new tokens (a row verifying drafts: once verified, `settle_verified`)."""
        self.registered_this_step.clear()
        for seq, n in zip(seqs, num_new):
            if not seq.spec_tokens:
                seq.num_computed_tokens += n

    def rollback(self) -> None:
        """The step failed: forget the blocks it registered (their K/V were never written);
        the engine then fails the requests that held them."""
        for block in self.registered_this_step:
            if self.cache.forget(block) and block.ref_count == 0:
                self.free_block_ids.append(block.block_id)
        self.registered_this_step.clear()

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Cached blocks are freed tail first, so a sequence's last
        blocks are evicted before its prefix, the part other requests are likelier to share."""
        for block_id in reversed(seq.block_table[seq.num_dropped_blocks:]):
            self._release(block_id)
        seq.block_table.clear()
        seq.num_computed_tokens = seq.num_dropped_blocks = 0
        assert self.num_free_blocks <= self.num_blocks
