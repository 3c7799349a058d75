"""Automatic prefix caching: full KV blocks found again by the hash of their content.

A full block's hash covers its parent block's hash, its token ids and the adapter key: the
(adapter name, version) whose LoRA made its K/V, or None for the base model. LoRA on k_proj or
v_proj changes the K/V of the very same tokens, so blocks are never shared across adapters, nor
across versions of one adapter: a re-registered adapter gets a new version, its old blocks are
never matched again and age out of the LRU like any other.

The hash is SHA-256 over a fixed binary layout (32-byte parent, length-prefixed adapter key,
little-endian int64 token ids), so equal hashes mean equal (prefix, adapter) with cryptographic
certainty and a hit is trusted without comparing tokens. Python's `hash()` of a tuple chain
would be 64 bits, salted per process and collision-prone enough to need a token check.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

CacheKey = tuple[str, int] | None  # (adapter name, version), None for the base model
_ROOT = bytes(32)  # the parent of every sequence's first block


def block_hash(parent: bytes | None, token_ids: Tokens[int], key: CacheKey) -> bytes:
    """The content hash of one full block: sha256(parent, adapter key, token ids)."""
    h = hashlib.sha256(parent or _ROOT)
    if key is None:
        h.update(b"\x00")
    else:
        name = key[0].encode()
        h.update(b"\x01" + struct.pack("<I", len(name)) + name + struct.pack("<q", key[1]))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0  # sequences whose block table holds it
    hash: bytes | None = None  # set once full and registered; dropped on eviction


@dataclass(slots=True)
class PrefixCacheStats:
    """Tokens looked up at admission and tokens found (vLLM's prefix_cache_queries/hits)."""

    queries: int = 0
    hits: int = 0


class PrefixCache:
    """Registered full blocks by hash, and the LRU of those no sequence references.

    A block with ref_count 0 and a hash sits in `evictable` (least recently freed first): it
    counts as free, and is handed out again only when no truly free block is left.
    """

    def __init__(self) -> None:
        self.by_hash: dict[bytes, Block] = {}
        self.evictable: OrderedDict[int, Block] = OrderedDict()
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self.by_hash)

    def get(self, h: bytes) -> Block | None:
        return self.by_hash.get(h)

    def register(self, block: Block, h: bytes) -> bool:
        """`block` is being filled with content hash `h`; whether it joined the cache now."""
        assert block.hash in (None, h), "a cached block changed content"
        if block.hash is None and h not in self.by_hash:
            block.hash = h
            self.by_hash[h] = block
            return True
        # else: cached already, or a duplicate of a cached block (two sequences computed the
        # same prefix); the duplicate stays unhashed and is freed as a plain block.
        return False

    def forget(self, block: Block) -> bool:
        """Drop `block` from the cache (its K/V are not what its hash says); whether it was in
        it. An unreferenced block leaves the LRU too: the caller frees it."""
        if block.hash is None or self.by_hash.get(block.hash) is not block:
            return False
        del self.by_hash[block.hash]
        block.hash = None
        self.evictable.pop(block.block_id, None)
        return True

    def park(self, block: Block) -> None:
        """No sequence references `block` any more: keep its K/V until the space is needed."""
        assert block.ref_count == 0 and block.hash is not None
        self.evictable[block.block_id] = block

    def revive(self, block: Block) -> None:
        """A parked block was matched again: it is no longer evictable."""
        del self.evictable[block.block_id]

    def evict(self) -> Block:
        """The least recently freed cached block, its hash forgotten, ready for new K/V."""
        _, block = self.evictable.popitem(last=False)
        del self.by_hash[block.hash]
        block.hash = None
        return block
