"""Parts of a quantized weight (engine/quant/shard.py): a merged slice's rows and a
tensor-parallel rank's rows or input columns dequantize to exactly that part of the whole
weight; a column split that would cut a quantization group, or an int4 byte, is refused."""

import pytest
import torch

from loragw.engine.quant.shard import columns, rows
from loragw.kernels.quant import QuantWeight, dequantize, pack_int4


def weight(group: int, act_order: bool = False, in_features: int = 128) -> QuantWeight:
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (12, in_features), generator=g, dtype=torch.int8)
    groups = -(-in_features // group)
    w = QuantWeight("int4", pack_int4(q), torch.rand(12, groups, generator=g),
                    torch.randint(-8, 8, (12, groups), generator=g, dtype=torch.int8), group,
                    in_features)
    if act_order:
        w.g_idx = torch.randperm(in_features, generator=g).div(group, rounding_mode="floor")[
            None].to(torch.int32)
        w.row_slice = torch.zeros(12, dtype=torch.int32)
    w.check()
    return w


@pytest.mark.parametrize("group, act_order", [(32, False), (128, False), (32, True)])
def test_parts_dequantize_to_the_parts_of_the_whole(group, act_order):
    w = weight(group, act_order)
    whole = dequantize(w)
    assert torch.equal(dequantize(rows(w, 4, 5)), whole[4:9])
    for start, length in ((0, 64), (64, 64), (32, 32)):
        part = columns(w, start, length, "x")
        part.check()
        assert torch.equal(dequantize(part), whole[:, start:start + length])


def test_a_split_inside_a_group_or_a_byte_is_refused_naming_the_tensor():
    with pytest.raises(ValueError, match="would cut a quantization group of o_proj"):
        columns(weight(64), 32, 64, "o_proj")
    with pytest.raises(ValueError, match="int4 columns inside a byte"):
        columns(weight(32, act_order=True), 33, 32, "o_proj")
