"""Which part of every weight a tensor-parallel rank holds (Megatron-style sharding).

    column-parallel  q/k/v, gate/up, lm_head: output rows split; no communication
    row-parallel     o, down: input columns split; the partial outputs all-reduced
    vocab-parallel   embed_tokens, lm_head: vocabulary rows split (padded to a multiple of N)

KV heads split with the query heads that read them; with fewer KV heads than ranks each rank
holds the one KV head its query heads use (replicated across the ranks that share it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Shard:
    rank: int = 0
    size: int = 1

    def split(self, n: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's even part of n items."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by --tensor-parallel-size "
                             f"{self.size}")
        length = n // self.size
        return self.rank * length, length

    def padded_split(self, n: int) -> tuple[int, int, int]:
        """(start, length, real) of this rank's part of n rows padded to a multiple of size:
        rows [start, start + real) exist, the rest of `length` is padding."""
        length = -(-n // self.size)
        start = self.rank * length
        return start, length, max(0, min(length, n - start))

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, KV heads) this rank holds for its query heads."""
        self.split(num_heads, "num_attention_heads")
        if num_kv_heads % self.size == 0:
            return self.split(num_kv_heads, "num_key_value_heads")
        if self.size % num_kv_heads:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) neither divides nor is a "
                             f"multiple of --tensor-parallel-size {self.size}")
        return self.rank * num_kv_heads // self.size, 1


ONE = Shard()  # the whole model on one device: every default
