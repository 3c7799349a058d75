"""kernels/quant.py's layout: int4 packing, dequantize on hand-computed examples, check()."""

import pytest
import torch

from loragw.kernels.quant import (
    QuantWeight,
    dequant_linear,
    dequantize,
    oracle_linear,
    pack_int4,
    unpack_int4,
)


def test_pack_unpack_round_trip_even_and_odd():
    gen = torch.Generator().manual_seed(0)
    for columns in (1, 2, 7, 64, 201):
        q = torch.randint(-8, 8, (3, columns), generator=gen, dtype=torch.int8)
        packed = pack_int4(q)
        assert packed.dtype == torch.uint8 and packed.shape == (3, (columns + 1) // 2)
        assert torch.equal(unpack_int4(packed, columns), q)


def test_int4_nibble_order_and_odd_padding():
    """Column 2j in the low nibble of byte j, stored as q + 8; an odd row's last high nibble
    is 8 (q = 0)."""
    q = torch.tensor([[-8, 7, 3], [0, -1, 5]])
    assert pack_int4(q).tolist() == [[0xF0, 0x8B], [0x78, 0x8D]]


def test_dequantize_int4_asym_groups_by_hand():
    """I = 3 in groups of 2 (the last one partial): W[o, k] = (q - z[o, k // 2]) * s[o, k // 2]."""
    w = QuantWeight("int4", pack_int4(torch.tensor([[-8, 7, 3], [0, -1, 5]])),
                    scales=torch.tensor([[0.5, 2.0], [0.25, 1.5]]),
                    zeros=torch.tensor([[1, -2], [0, 3]], dtype=torch.int8), group_size=2,
                    in_features=3)
    w.check()
    want = [[(-8 - 1) * 0.5, (7 - 1) * 0.5, (3 + 2) * 2.0], [0.0, -1 * 0.25, (5 - 3) * 1.5]]
    assert dequantize(w).tolist() == want
    assert dequantize(w, torch.float64).dtype == torch.float64
    x = torch.tensor([[1.0, 2.0, -1.0]])
    assert oracle_linear(x, w, torch.tensor([0.5, -0.5])).tolist() == [[-4.5 + 6 - 10 + 0.5, -0.5 - 3 - 0.5]]
    assert dequant_linear(x, w).tolist() == [[-8.5, -3.5]]


def test_dequantize_int8_channel():
    w = QuantWeight("int8", torch.tensor([[-128, 127], [1, -3]], dtype=torch.int8),
                    torch.tensor([[0.5], [2.0]]), None, group_size=2, in_features=2)
    w.check()
    assert dequantize(w).tolist() == [[-64.0, 63.5], [2.0, -6.0]]


def test_fp8_bits():
    """qweight holds float8_e4m3fn bits: 0x38 = 1, 0x3C = 1.5, 0xC0 = -2, 0x7E = 448 (the
    largest), 0x01 = 2^-9 (the smallest subnormal), 0x80 = -0."""
    bits = torch.tensor([[0x38, 0x3C, 0xC0], [0x7E, 0x01, 0x80]], dtype=torch.uint8)
    w = QuantWeight("fp8", bits, torch.tensor([[0.5], [2.0]]), None, group_size=3, in_features=3)
    w.check()
    assert dequantize(w).tolist() == [[0.5, 0.75, -1.0], [896.0, 2.0 ** -8, -0.0]]


def test_act_order_two_slices_by_hand():
    """Rows 0, 1 read g_idx row 0; row 2 reads row 1: W[o, k] = q[o, k] * s[o, g_idx[slice(o), k]]."""
    q = torch.tensor([[1, 2, 3, 4], [-1, -2, -3, -4], [5, 6, 7, -8]])
    w = QuantWeight("int4", pack_int4(q), torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]]),
                    None, group_size=2, in_features=4,
                    g_idx=torch.tensor([[1, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.int32),
                    row_slice=torch.tensor([0, 0, 1], dtype=torch.int32))
    w.check()
    assert dequantize(w).tolist() == [[10.0, 2.0, 30.0, 4.0], [-20.0, -4.0, -60.0, -8.0],
                                      [15.0, 18.0, 210.0, -240.0]]


def test_num_bytes():
    w = QuantWeight("int4", torch.zeros(4, 3, dtype=torch.uint8), torch.zeros(4, 2),
                    torch.zeros(4, 2, dtype=torch.int8), group_size=4, in_features=5)
    assert w.num_bytes == 4 * 3 + 4 * 2 * 4 + 4 * 2


@pytest.mark.parametrize("change", [
    {"qweight": torch.zeros(4, 5, dtype=torch.uint8)},   # int4 unpacked: [O, I], not [O, 3]
    {"qweight": torch.zeros(4, 3, dtype=torch.int8)},    # int4 codes are uint8 bytes
    {"scales": torch.zeros(4, 3)},                       # G = ceil(5 / 4) = 2
    {"scales": torch.zeros(4, 2, dtype=torch.float16)},
    {"zeros": torch.zeros(4, 2, dtype=torch.uint8)},
    {"kind": "int3", "qweight": torch.zeros(4, 5, dtype=torch.uint8)},
    {"g_idx": torch.zeros(2, 5, dtype=torch.int32)},     # act order without row_slice
    {"g_idx": torch.full((1, 5), 2, dtype=torch.int32),  # group 2 of 2: out of range
     "row_slice": torch.zeros(4, dtype=torch.int32)},
    {"g_idx": torch.zeros(1, 5, dtype=torch.int32),      # slice 1 of 1: out of range
     "row_slice": torch.ones(4, dtype=torch.int32)},
    {"zeros": torch.full((4, 2), 8, dtype=torch.int8)},  # past int4's -8..7
], ids=["unpacked", "signed-bytes", "groups", "fp16-scales", "uint8-zeros", "kind", "no-row-slice",
        "group-out-of-range", "slice-out-of-range", "zero-out-of-range"])
def test_check_rejects_a_wrong_layout(change):
    fields = dict(kind="int4", qweight=torch.zeros(4, 3, dtype=torch.uint8),
                  scales=torch.zeros(4, 2), zeros=torch.zeros(4, 2, dtype=torch.int8),
                  group_size=4, in_features=5)
    QuantWeight(**fields).check()
    with pytest.raises(ValueError):
        QuantWeight(**(fields | change)).check()
