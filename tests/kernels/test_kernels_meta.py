"""make_lora_meta: grouping tokens by slot, and tiles whose count depends only on (T, S)."""

import pytest
import torch
from lora_cases import POPULARITIES, token_slots

from loragw.kernels import LoRAMeta, make_lora_meta
from loragw.kernels.meta import DECODE_MAX_TOKENS, num_tiles_bound, tile_m_for


def test_groups_tokens_by_slot_stably_with_no_adapter_last():
    meta = make_lora_meta(torch.tensor([2, -1, 0, 2, 0, -1, 2]), num_slots=4)
    assert meta.sorted_token_ids.tolist() == [2, 4, 0, 3, 6, 1, 5]
    assert meta.slot_counts.tolist() == [2, 0, 3, 0]
    assert meta.slot_starts.tolist() == [0, 2, 2, 5]
    assert meta.token_slots.tolist() == [2, -1, 0, 2, 0, -1, 2]
    assert (meta.num_slots, meta.max_tokens_per_slot, meta.has_lora) == (4, 3, True)
    assert meta.segments == ((0, 0, 2), (2, 2, 3))
    for name in ("token_slots", "sorted_token_ids", "slot_counts", "slot_starts",
                 "tile_slots", "tile_starts", "tile_lens"):
        assert getattr(meta, name).dtype == torch.int32, name


def test_all_none_has_no_lora_and_only_empty_tiles():
    meta = make_lora_meta(torch.full((5,), -1), num_slots=3)
    assert not meta.has_lora and meta.max_tokens_per_slot == 0 and meta.segments == ()
    assert meta.sorted_token_ids.tolist() == [0, 1, 2, 3, 4]
    assert (meta.tile_slots == -1).all() and (meta.tile_lens == 0).all()


def test_empty_batch():
    meta = make_lora_meta(torch.zeros(0, dtype=torch.int32), num_slots=2)
    assert meta.num_tokens == 0 and not meta.has_lora and meta.tile_slots.numel() == 0


@pytest.mark.parametrize("bad", [4, -2])
def test_rejects_slots_outside_the_pool(bad):
    with pytest.raises(ValueError, match=rf"slots \[{bad}\] outside \[-1, 4\)"):
        make_lora_meta(torch.tensor([0, bad, 1]), num_slots=4)


@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("T,S,block_m", [(1, 1, 16), (33, 4, 16), (33, 8, 16), (100, 8, 16),
                                         (300, 4, 64), (47, 47, 16)])
def test_tiles_cover_each_token_once_with_a_data_independent_count(popularity, T, S, block_m):
    slots = token_slots(popularity, T, S, torch.Generator().manual_seed(T * S))
    meta = make_lora_meta(slots, S, block_m=block_m)
    assert meta.tile_slots.shape == (num_tiles_bound(T, S, block_m),)  # fixed grid for a given T, S
    seen = []
    for slot, start, n in zip(meta.tile_slots.tolist(), meta.tile_starts.tolist(), meta.tile_lens.tolist(),
                               strict=True):
        if slot < 0:
            assert n == 0
            continue
        assert 1 <= n <= block_m
        tokens = meta.sorted_token_ids[start:start + n].tolist()
        assert all(slots[t] == slot for t in tokens)
        seen += tokens
    assert sorted(seen) == sorted(t for t in range(T) if slots[t] >= 0)


def test_tile_bound_is_reached_when_every_slot_spills_one_token():
    S, block_m = 4, 16
    slots = torch.arange(S).repeat_interleave(block_m + 1)          # 17 tokens per slot: 2 tiles each
    meta = make_lora_meta(slots, S, block_m=block_m)
    assert (meta.tile_slots >= 0).sum() == 2 * S == num_tiles_bound(len(slots), S, block_m)


def test_decode_steps_get_small_tiles():
    assert tile_m_for(1) == tile_m_for(DECODE_MAX_TOKENS) == 16
    assert tile_m_for(DECODE_MAX_TOKENS + 1) == 64
    assert make_lora_meta(torch.zeros(DECODE_MAX_TOKENS + 1, dtype=torch.long), 1).block_m == 64


def test_refilling_a_captured_meta_keeps_the_tensors():
    static = make_lora_meta(torch.tensor([0, 0, 1, -1]), num_slots=2)
    tensors = [static.tile_slots, static.sorted_token_ids]
    assert make_lora_meta(torch.tensor([1, -1, -1, 1]), num_slots=2, out=static) is static
    assert static.tile_slots is tensors[0] and static.sorted_token_ids is tensors[1]
    assert static.sorted_token_ids.tolist() == [0, 3, 1, 2]
    assert static.segments == ((1, 0, 2),) and static.max_tokens_per_slot == 2
    with pytest.raises(AssertionError, match="out holds 4 tokens"):
        make_lora_meta(torch.tensor([0]), num_slots=2, out=static)


def test_meta_is_a_slotted_dataclass():
    assert not hasattr(make_lora_meta(torch.tensor([0]), 1), "__dict__")
    assert LoRAMeta.__slots__
