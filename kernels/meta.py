"""LoRAMeta: which adapter slot each token uses, in the grouped form every kernel reads.

Built once per engine step by `make_lora_meta` and shared by every LoRA projection of that
step. Tokens are grouped by slot through `sorted_token_ids` (an index, so x never moves);
each slot's group is cut into tiles of `block_m` tokens for the Triton kernels. The tile
arrays have a length that depends only on (T, S, block_m), so a kernel grid built from them
is fixed for a given batch size and can be captured in a CUDA graph.

The grouping is planned on the host (the slots come from the scheduler, a host list) in NumPy
and lands on the device in one copy: every int32 field is a view of one packed tensor,
    packed = [token_slots T | sorted_token_ids T | slot_counts S | slot_starts S |
              tile_slots NT | tile_starts NT | tile_lens NT]
so refilling a captured meta in place (`make_lora_meta(..., out=meta)`) is one copy too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

# Tokens per tile when a step has at most this many tokens (decode): a 16-row tile is the
# smallest `tl.dot` accepts, and with distinct adapters most tiles hold one token anyway.
DECODE_MAX_TOKENS = 256
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64
FIELDS = ("token_slots", "sorted_token_ids", "slot_counts", "slot_starts", "tile_slots",
          "tile_starts", "tile_lens")


def host_to_device(data: Tensor | list, device: torch.device | str) -> Tensor:
    """A host tensor, or a (nested) list of ints made int64, on `device` (a CPU tensor as it
    is). To a GPU through pinned memory, without waiting: torch follows a copy from pageable
    memory with a stream sync, so the host would wait for every step already queued (async
    scheduling's overlap gone)."""
    t = data if isinstance(data, Tensor) else torch.tensor(data, dtype=torch.long)
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def tile_m_for(num_tokens: int) -> int:
    """Tokens per tile for a step of `num_tokens` tokens (decode-sized steps get small tiles)."""
    return DECODE_BLOCK_M if num_tokens <= DECODE_MAX_TOKENS else PREFILL_BLOCK_M


def num_tiles_bound(num_tokens: int, num_slots: int, block_m: int) -> int:
    """Most tiles any mapping of T tokens onto S slots can need: sum_s cdiv(c_s, M) where
    at most min(S, T) counts are non-zero and they sum to at most T."""
    busy = min(num_slots, num_tokens)
    return -(-(num_tokens + busy * (block_m - 1)) // block_m)


def _lengths(T: int, S: int, NT: int) -> tuple[int, ...]:
    return (T, T, S, S, NT, NT, NT)


def _views(packed, T: int, S: int, NT: int) -> list:
    """The seven fields of `packed` (an array or a tensor), by slicing: np.split and
    torch.split cost more than the planning itself at decode sizes."""
    views, start = [], 0
    for n in _lengths(T, S, NT):
        views.append(packed[start:start + n])
        start += n
    return views


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
    packed: Tensor             # [2T + 2S + 3NT] int32: the storage of every field above

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @classmethod
    def empty(cls, num_tokens: int, num_slots: int, device: torch.device | str = "cpu",
              block_m: int | None = None) -> LoRAMeta:
        """A meta of T tokens, all without an adapter: the static buffers a CUDA graph reads,
        refilled each step by make_lora_meta(..., out=meta)."""
        return make_lora_meta([-1] * num_tokens, num_slots, block_m=block_m, device=device)


def make_lora_meta(token_slots: Tensor | list[int] | np.ndarray, num_slots: int, *,
                   block_m: int | None = None, device: torch.device | str | None = None,
                   out: LoRAMeta | None = None) -> LoRAMeta:
    """Group tokens by adapter slot. token_slots: [T] int (a tensor, list or array), values in
    [-1, S). The meta lands on `device` (default: the tensor's, else the CPU); with `out`, in
    `out`'s tensors (same T, S and block_m), which is returned."""
    if isinstance(token_slots, Tensor):
        assert token_slots.dim() == 1, f"token_slots must be [T], got shape {tuple(token_slots.shape)}"
        device = token_slots.device if device is None else device
        token_slots = token_slots.cpu().numpy()
    slots = np.asarray(token_slots, dtype=np.int64)
    assert slots.ndim == 1, f"token_slots must be [T], got shape {slots.shape}"
    assert num_slots >= 1, f"num_slots must be >= 1, got {num_slots}"
    S, T = num_slots, slots.shape[0]
    block_m = tile_m_for(T) if block_m is None else block_m
    assert block_m >= 1 and block_m & (block_m - 1) == 0, f"block_m must be a power of 2, got {block_m}"
    if T and (slots.min() < -1 or slots.max() >= S):
        bad = (slots < -1) | (slots >= S)
        raise ValueError(f"token_slots holds slots {np.unique(slots[bad])[:8].tolist()} outside "
                         f"[-1, {S}); the adapter pool has {S} slots")

    key = np.where(slots == -1, S, slots)                         # [T] -1 sorts after every slot
    counts = np.bincount(key, minlength=S + 1)[:S]                # [S]
    starts = np.cumsum(counts) - counts                           # [S] exclusive prefix sum
    nt = num_tiles_bound(T, S, block_m)
    tiles = -(-counts // block_m)                                 # [S] tiles per slot
    owner = np.repeat(np.arange(S), tiles)                        # [used] slot of each tile
    local = np.arange(owner.shape[0]) - np.repeat(np.cumsum(tiles) - tiles, tiles)

    packed = np.zeros(2 * T + 2 * S + 3 * nt, dtype=np.int32)
    token, sorted_ids, cnt, st, tile_slot, tile_start, tile_len = _views(packed, T, S, nt)
    token[:] = slots
    sorted_ids[:] = np.argsort(key, kind="stable")
    cnt[:], st[:] = counts, starts
    used = owner.shape[0]
    tile_slot[:used], tile_slot[used:] = owner, -1                # empty tiles: slot -1, len 0
    tile_start[:used] = starts[owner] + local * block_m
    tile_len[:used] = np.minimum(counts[owner] - local * block_m, block_m)

    segments = tuple((int(s), int(starts[s]), int(counts[s])) for s in np.flatnonzero(counts))
    host = torch.from_numpy(packed)
    if out is not None:
        assert (out.num_slots, out.block_m, out.num_tokens) == (S, block_m, T), (
            f"out holds {out.num_tokens} tokens x {out.num_slots} slots (tiles of "
            f"{out.block_m}); got {T} x {S} ({block_m})")
        out.packed.copy_(host, non_blocking=True)
        out.max_tokens_per_slot = int(counts.max(initial=0))
        out.has_lora, out.segments = bool(segments), segments
        return out
    device = torch.device("cpu") if device is None else torch.device(device)
    # A fresh array: on the CPU the meta may own it; elsewhere one host-to-device copy.
    stored = host_to_device(host, device)
    views = _views(stored, T, S, nt)
    return LoRAMeta(**dict(zip(FIELDS, views, strict=True)), num_slots=S,
                    max_tokens_per_slot=int(counts.max(initial=0)), has_lora=bool(segments),
                    segments=segments, block_m=block_m, packed=stored)
