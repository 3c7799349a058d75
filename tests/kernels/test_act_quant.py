"""kernels/act_quant.py: W8A8 / FP8 input activations quantized exactly as compressed-tensors'
forward does. The golden outputs below were computed by compressed-tensors 0.19 itself
(`compute_dynamic_scales_and_zp` + `fake_quantize` on x as a [1, T, H] Linear input, in
.venv-quant, which this venv cannot import); the other tests state the formula's properties a
reader can check by hand, and how merged slices, GEMMs and tensor-parallel ranks use it."""

import pytest
import torch
import torch.nn.functional as F

from loragw.kernels.act_quant import ActQuant, join_static, quantize_activations
from loragw.kernels.quant import QuantWeight, dequant_linear, dequantize, oracle_linear

X = [[0.3, -1.7, 2.25, 0.01, -0.6, 1.1, -2.4, 0.77],
     [5.0, 4.1, 0.2, 3.3, 1.9, 0.0, 2.7, 0.45],
     [0.0] * 8]
ZERO_ROW = [0.0] * 8
# name -> (ActQuant, x dtype, compressed-tensors' x_hat of X)
GOLDEN = {
    "int8-token": (ActQuant("int8", True), torch.float32, [
        [0.3011764883995056, -1.694117784500122, 2.2588236331939697, 0.0188235305249691,
         -0.6023529767990112, 1.0917648077011108, -2.409411907196045, 0.7717647552490234],
        [4.9803924560546875, 4.117647171020508, 0.19607843458652496, 3.2941176891326904,
         1.8823530673980713, 0.0, 2.7058825492858887, 0.4313725531101227], ZERO_ROW]),
    # bfloat16 rounds the range 255 to 256: s = max|x| / 128
    "int8-token-bf16": (ActQuant("int8", True), torch.bfloat16, [
        [0.302734375, -1.703125, 2.25, 0.0189208984375, -0.60546875, 1.09375, -2.40625,
         0.77734375],
        [5.0, 4.09375, 0.1962890625, 3.296875, 1.890625, 0.0, 2.71875, 0.431640625], ZERO_ROW]),
    "int8-token-asym": (ActQuant("int8", True, symmetric=False), torch.float32, [
        [0.2917647063732147, -1.6958823204040527, 2.24294114112854, 0.01823529414832592,
         -0.6017646789550781, 1.0941176414489746, -2.4070587158203125, 0.7658823728561401],
        [5.0, 4.098039150238037, 0.19607843458652496, 3.2941176891326904, 1.901960849761963,
         0.0, 2.7058825492858887, 0.45098039507865906], ZERO_ROW]),
    "fp8-group4": (ActQuant("fp8", True, group_size=4), torch.float32, [
        [0.3013392686843872, -1.7678570747375488, 2.25, 0.010044642724096775,
         -0.6000000238418579, 1.1142857074737549, -2.4000000953674316, 0.7714285850524902],
        [5.0, 3.9285714626312256, 0.2008928656578064, 3.2142858505249023, 1.9285714626312256,
         0.0, 2.700000047683716, 0.43392857909202576], ZERO_ROW]),
    "fp8-static": (ActQuant("fp8", False, scales=torch.tensor([0.0123])), torch.float32, [
        [0.295199990272522, -1.7711999416351318, 2.164799928665161, 0.009993749670684338,
         -0.590399980545044, 1.0823999643325806, -2.361599922180176, 0.7871999740600586],
        [5.116799831390381, 3.935999870300293, 0.19679999351501465, 3.1487998962402344,
         1.9679999351501465, 0.0, 2.755199909210205, 0.44279998540878296], ZERO_ROW]),
    # clamped at q_max: (127 - 13) * s; the scale is rounded to float16 as the model holds it
    "int8-static-asym-fp16": (ActQuant("int8", False, symmetric=False,
                                       scales=torch.tensor([0.0217]), zeros=torch.tensor([13.0])),
                              torch.float16, [
        [0.3037109375, -1.6923828125, 2.255859375, 0.0, -0.607421875, 1.1064453125,
         -2.408203125, 0.75927734375],
        [2.47265625, 2.47265625, 0.1953125, 2.47265625, 1.9091796875, 0.0, 2.47265625,
         0.45556640625], ZERO_ROW]),
}


@pytest.mark.parametrize("name", GOLDEN)
def test_equals_compressed_tensors_bit_for_bit(name):
    act, dtype, want = GOLDEN[name]
    got = quantize_activations(torch.tensor(X, dtype=dtype), act)
    assert got.dtype == dtype
    assert got.float().tolist() == want


def test_int8_symmetric_grid_by_hand():
    """s = max|x| / 127.5: +max rounds to 127 (clamped), -max to -128, every value on s's grid."""
    x = torch.tensor([[2.55, -2.55, 1.0, 0.0], [-1.0, 0.5, 0.25, 0.0]])
    got = quantize_activations(x, ActQuant("int8", True))
    scale = x.abs().amax(-1, keepdim=True) / 127.5
    codes = got / scale
    assert torch.equal(codes, torch.round(codes))
    assert codes[0, :2].tolist() == [127.0, -128.0]
    assert codes.min() >= -128 and codes.max() <= 127


def test_fp8_values_are_e4m3_times_their_scale():
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(1)) * 3
    got = quantize_activations(x, ActQuant("fp8", True, group_size=16))
    scale = x.unflatten(-1, (2, 16)).abs().amax(-1, keepdim=True) / 448
    codes = (got.unflatten(-1, (2, 16)) / scale)
    assert torch.allclose(codes, codes.to(torch.float8_e4m3fn).float(), rtol=1e-6, atol=0)
    assert (got - x).abs().max() < 0.07 * x.abs().max()  # and close to x


def test_a_group_as_wide_as_the_row_is_per_token_and_empty_input_passes():
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(quantize_activations(x, ActQuant("fp8", True, group_size=8)),
                       quantize_activations(x, ActQuant("fp8", True)))
    assert quantize_activations(x[:0], ActQuant("int8", True)).shape == (0, 8)


def weight(rows: int = 6, columns: int = 8, seed: int = 3) -> QuantWeight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (rows, columns), generator=gen, dtype=torch.int8)
    return QuantWeight("int8", q, torch.rand(rows, 1, generator=gen) / 100, None, columns,
                       columns)


def test_the_gemms_multiply_the_quantized_input_and_lora_would_see_x():
    w, x = weight(), torch.tensor(X)
    w.act = ActQuant("int8", True)
    x_hat = quantize_activations(x, w.act)
    assert not torch.equal(x_hat, x)
    assert torch.equal(dequant_linear(x, w), F.linear(x_hat, dequantize(w)))
    torch.testing.assert_close(oracle_linear(x, w), x_hat.double() @ dequantize(w).double().T)


def test_merged_slices_keep_their_own_static_scales():
    """q|k with input scales 0.01 and 0.03: each slice's rows see x quantized with its own."""
    w, x = weight(), torch.tensor(X)
    bias = torch.arange(6.0)
    one = [ActQuant("int8", False, scales=torch.tensor([s])) for s in (0.01, 0.03)]
    w.act = join_static([(one[0], 4), (one[1], 2)])
    assert w.act.rows == (4, 2)
    w.check()
    want = torch.cat([F.linear(quantize_activations(x, a), dequantize(w)[rows], bias[rows])
                      for a, rows in zip(one, (slice(0, 4), slice(4, 6)), strict=True)], -1)
    assert torch.equal(dequant_linear(x, w, bias), want)
    assert not torch.equal(want, F.linear(quantize_activations(x, one[0]), dequantize(w), bias))
    assert w.rows(4, 2).act.scales.tolist() == [pytest.approx(0.03)]


def test_join_collapses_equal_scales_and_refuses_mixed_schemes():
    same = ActQuant("fp8", False, scales=torch.tensor([0.5]))
    joined = join_static([(same, 4), (same, 2)])
    assert joined.rows == () and joined.scales.tolist() == [0.5]
    dynamic = ActQuant("fp8", True)
    assert join_static([(dynamic, 4), (dynamic, 2)]) is dynamic
    assert join_static([(None, 4), (None, 2)]) is None
    with pytest.raises(ValueError, match="quantize their inputs differently"):
        join_static([(dynamic, 4), (same, 2)])


@pytest.mark.parametrize("act, message", [
    (ActQuant("int4", True), "kind 'int4'"),
    (ActQuant("fp8", False, scales=torch.tensor([0.0])), "not a positive finite"),
    (ActQuant("fp8", False, scales=torch.tensor([float("nan")])), "not a positive finite"),
    (ActQuant("fp8", False), "static activations need float32 scales"),
    (ActQuant("fp8", False, scales=torch.tensor([1.0, 2.0]), rows=(3, 2)), "not 6"),
    (ActQuant("int8", True, group_size=3), "groups of 3 do not divide 8"),
])
def test_check_names_what_is_wrong(act, message):
    w = weight()
    w.act = act
    with pytest.raises(ValueError, match=message):
        w.check()


@pytest.mark.parametrize("symmetric", [True, False])
def test_a_row_split_over_ranks_gets_the_whole_rows_scale(symmetric):
    """Tensor parallelism: each rank holds half of every token's columns; with the amax maxed
    over both halves, each half is the whole row's quantization cut in two."""
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(4))
    whole = quantize_activations(x, ActQuant("int8", True, symmetric))
    halves = (x[:, :4], x[:, 4:])
    split = ActQuant("int8", True, symmetric, spans_ranks=True)
    for rank, part in enumerate(halves):
        other = halves[1 - rank]

        def reduce_max(t, other=other):  # what the other rank contributes to the max
            t.copy_(torch.max(t, torch.stack((-other.amin(-1, keepdim=True).unsqueeze(-1),
                                              other.amax(-1, keepdim=True).unsqueeze(-1)))))
        got = quantize_activations(part, split, reduce_max)
        assert torch.equal(got, whole[:, 4 * rank:4 * rank + 4])
