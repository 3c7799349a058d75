"""LoRAMeta: which adapter slot each token uses, in the grouped form every kernel reads.

Built once per engine step by `make_lora_meta` and shared by every LoRA projection of that
step. Tokens are grouped by slot through `sorted_token_ids` (an index, so x never moves);
each slot's group is cut into tiles of `block_m` tokens for the Triton kernels. The tile
arrays have a length that depends only on (T, S, block_m), so a kernel grid built from them
is fixed for a given batch size and can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Tokens per tile when a step has at most this many tokens (decode): a 16-row tile is the
# smallest `tl.dot` accepts, and with distinct adapters most tiles hold one token anyway.
DECODE_MAX_TOKENS = 256
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64


def tile_m_for(num_tokens: int) -> int:
    """Tokens per tile for a step of `num_tokens` tokens (decode-sized steps get small tiles)."""
    return DECODE_BLOCK_M if num_tokens <= DECODE_MAX_TOKENS else PREFILL_BLOCK_M


def num_tiles_bound(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Most tiles any mapping of T tokens onto S slots can need: sum_s cdiv(c_s, M) where
    at most min(S, T) counts are non-zero and they sum to at most T."""
    busy = min(num_slots, num_tokens)
    return -(-(num_tokens + busy * (block_m - 1)) // block_m)


@dataclass(slots=True)
class LoRAMeta:
    token_slots: Tensor        # [T] int32: slot of each token, -1 = no adapter
    sorted_token_ids: Tensor   # [T] int32: tokens grouped by slot (stable), slot -1 last
    slot_counts: Tensor        # [S] int32: tokens per slot
    slot_starts: Tensor        # [S] int32: offset of each slot's first token in sorted_token_ids
    num_slots: int             # S, the pool size (fixed)
    max_tokens_per_slot: int   # max(slot_counts), on the CPU
    has_lora: bool             # False when every token is -1: callers skip LoRA entirely
    # CPU view for the torch backend: (slot, start, count) of every slot that has tokens.
    segments: tuple[tuple[int, int, int], ...]
    # Tiles for the Triton kernels; NT = num_tiles_bound(T, S, block_m), fixed per (T, S).
    block_m: int               # tokens per tile
    tile_slots: Tensor         # [NT] int32: slot of each tile, -1 = empty tile (program exits)
    tile_starts: Tensor        # [NT] int32: offset of the tile's first token in sorted_token_ids
    tile_lens: Tensor          # [NT] int32: tokens in the tile, 1..block_m (0 when empty)

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    def copy_(self, other: LoRAMeta) -> LoRAMeta:
        """Copy `other` into this meta's tensors in place (static buffers of a CUDA graph)."""
        assert other.num_slots == self.num_slots and other.block_m == self.block_m, (
            "a captured meta can only take a step with the same pool size and tile size")
        for name in ("token_slots", "sorted_token_ids", "slot_counts", "slot_starts",
                     "tile_slots", "tile_starts", "tile_lens"):
            dst, src = getattr(self, name), getattr(other, name)
            assert dst.shape == src.shape, f"{name}: captured {tuple(dst.shape)}, got {tuple(src.shape)}"
            dst.copy_(src, non_blocking=True)
        self.max_tokens_per_slot = other.max_tokens_per_slot
        self.has_lora = other.has_lora
        self.segments = other.segments
        return self


def make_lora_meta(token_slots: Tensor, num_slots: int, *, block_m: int | None = None) -> LoRAMeta:
    """Group tokens by adapter slot. token_slots: [T] int (any device), values in [-1, S).

    One device-to-host copy (the slot counts) fills the CPU-side fields.
    """
    assert token_slots.dim() == 1, f"token_slots must be [T], got shape {tuple(token_slots.shape)}"
    assert num_slots >= 1, f"num_slots must be >= 1, got {num_slots}"
    S, T, device = num_slots, token_slots.shape[0], token_slots.device
    block_m = tile_m_for(T) if block_m is None else block_m
    assert block_m >= 1 and block_m & (block_m - 1) == 0, f"block_m must be a power of 2, got {block_m}"

    slots = token_slots.to(torch.int64)
    bad = (slots < -1) | (slots >= S)
    key = torch.where(slots == -1, S, slots)                      # [T] -1 sorts after every slot
    key = torch.where(bad, S + 1, key)
    sorted_ids = torch.sort(key, stable=True).indices             # [T]
    counts_all = torch.bincount(key, minlength=S + 2)             # [S+2]: slots, none, invalid
    counts = counts_all[:S]                                       # [S]
    starts = torch.cumsum(counts, 0) - counts                     # [S] exclusive prefix sum

    counts_cpu = counts_all.tolist()                              # the one sync
    if counts_cpu[S + 1]:
        bad_values = token_slots[bad].unique().tolist()[:8]
        raise ValueError(f"token_slots holds slots {bad_values} outside [-1, {S}); "
                         f"the adapter pool has {S} slots")
    segments, start = [], 0
    for slot, count in enumerate(counts_cpu[:S]):
        if count:
            segments.append((slot, start, count))
        start += count

    # Tile j belongs to the slot whose cumulative tile count first exceeds j.
    nt = num_tiles_bound(T, S, block_m)
    tiles_per_slot = (counts + block_m - 1) // block_m            # [S]
    tile_end = torch.cumsum(tiles_per_slot, 0)                    # [S] inclusive
    j = torch.arange(nt, device=device)                           # [NT]
    tile_slot = torch.searchsorted(tile_end, j, right=True)       # [NT] in [0, S]; S = empty
    owner = tile_slot.clamp(max=S - 1)
    local = j - (tile_end - tiles_per_slot)[owner]                # tile index within its slot
    tile_start = starts[owner] + local * block_m
    tile_len = (counts[owner] - local * block_m).clamp(0, block_m)
    empty = tile_slot >= S

    i32 = torch.int32
    return LoRAMeta(
        token_slots=token_slots.to(i32, copy=True),          # never aliases the caller's buffer
        sorted_token_ids=sorted_ids.to(i32),
        slot_counts=counts.to(i32),
        slot_starts=starts.to(i32),
        num_slots=S,
        max_tokens_per_slot=max(counts_cpu[:S], default=0),
        has_lora=bool(segments),
        segments=tuple(segments),
        block_m=block_m,
        tile_slots=torch.where(empty, -1, tile_slot).to(i32),
        tile_starts=torch.where(empty, 0, tile_start).to(i32),
        tile_lens=torch.where(empty, 0, tile_len).to(i32),
    )
