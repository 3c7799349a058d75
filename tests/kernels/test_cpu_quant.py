"""kernels/cpu_quant.py: the C quantized GEMM against the float64 oracle over a grid of kind x
group size (channel-wise, ragged, odd, smaller than a vector pair) x zero points x act order x
batch x shapes that are not multiples of a vector; each weight dequantize's float32 bit for bit
on both paths; the scalar build right too, and the AVX-512 build compiling; the engine serving
it on the CPU only after its start-up check."""

from __future__ import annotations

import subprocess

import pytest
import torch

from loragw.engine.forward import backends
from loragw.engine.forward.backends import Backends
from loragw.kernels import cpu_quant, native
from loragw.kernels.act_quant import ActQuant
from loragw.kernels.quant import KINDS, QuantWeight, dequant_linear, dequantize, oracle_linear

CPU = torch.device("cpu")
SCALAR = ("-march=x86-64",)  # no AVX2, FMA or F16C: the portable loops
AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
# (rows, columns): neither a multiple of 8; whole vector pairs and chunks; several chunks with a
# ragged last one
SHAPES = [(37, 75), (64, 256), (24, 600)]
# columns per group: 0 = channel-wise (the whole row); 7: odd (int4 groups start mid-byte); 24:
# not whole vector pairs; 32 and 128: what the tools write (ragged last group where I is not
# a multiple)
GROUPS = [0, 7, 24, 32, 128]


def weight(kind, shape, group, zeros, act_order, seed=0) -> QuantWeight:
    rows, columns = shape
    g = torch.Generator().manual_seed(seed)
    return cpu_quant.random_weight(kind, rows, columns, group or columns, zeros, act_order, g)


def assert_oracle(got, x, w, bias=None):
    assert got.shape == (*x.shape[:-1], w.out_features) and got.dtype == x.dtype
    assert cpu_quant.problem(got, x, w, bias) is None


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", [1, 2, 7, 32])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("kind", KINDS)
def test_quant_linear_is_the_oracle(kind, group, zeros, act_order, tokens, shape):
    w = weight(kind, shape, group, zeros, act_order)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, shape[1], generator=g)
    bias = torch.randn(shape[0], generator=g) if zeros else None
    assert_oracle(cpu_quant.quant_linear(x, w, bias), x, w, bias)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("tokens", [1, 3, 5, 9, 70])
@pytest.mark.parametrize("kind", KINDS)
def test_both_paths_at_every_batch(kind, tokens, direct):
    """The direct path in blocks of 4 tokens and a remainder; the tiled one in micro-tiles of
    2 or 4 tokens and blocks of 64, each with a remainder."""
    w = weight(kind, (37, 600), 32, True, False)
    x = torch.randn(tokens, 600, generator=torch.Generator().manual_seed(1))
    assert_oracle(cpu_quant.quant_linear(x, w, direct=direct), x, w)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("group,act_order", [(0, False), (7, False), (32, False), (24, True)])
@pytest.mark.parametrize("kind", KINDS)
def test_each_weight_is_the_float32_dequantize_gives_bit_for_bit(kind, group, act_order, direct):
    """x = I: y[k] is the column W[:, k] itself, one product and no sum to reorder."""
    w = weight(kind, (37, 75), group, True, act_order)
    y = cpu_quant.quant_linear(torch.eye(75), w, direct=direct)
    assert torch.equal(y, dequantize(w).T)


@pytest.mark.parametrize("direct", [True, False])
def test_fp8_decodes_every_code_but_nan(direct):
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    w = QuantWeight("fp8", codes[None], torch.ones(1, 1), None, 254, 254)
    y = cpu_quant.quant_linear(torch.eye(254), w, direct=direct)
    assert torch.equal(y[:, 0], codes.view(torch.float8_e4m3fn).float())


def test_strided_rows_leading_dims_and_other_dtypes():
    w = weight("int4", (37, 75), 32, True, False)
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(5, 200, generator=g)
    x = wide[:, 10:85]  # rows 200 floats apart
    assert_oracle(cpu_quant.quant_linear(x, w), x, w)
    x3 = torch.randn(2, 3, 75, generator=g)
    y3 = cpu_quant.quant_linear(x3, w)
    assert y3.shape == (2, 3, 37)
    assert_oracle(y3.view(6, 37), x3.view(6, 75), w)
    half = x3.bfloat16()  # computed in float32, returned in bfloat16
    y = cpu_quant.quant_linear(half, w)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, oracle_linear(half.float(), w).bfloat16())


def test_activations_are_quantized_first_as_the_weight_declares():
    w = weight("int8", (37, 75), 0, False, False)
    w.act = ActQuant("int8", dynamic=True)
    x = torch.randn(3, 75, generator=torch.Generator().manual_seed(3))
    got = cpu_quant.quant_linear(x, w)
    assert_oracle(got, x, w)  # the oracle quantizes x too
    torch.testing.assert_close(got, dequant_linear(x, w), rtol=1e-5, atol=1e-5)
    w.act = None
    assert not torch.allclose(got, cpu_quant.quant_linear(x, w), rtol=1e-5, atol=1e-5)


def test_use_direct_is_decode_batches_up_to_the_measured_bound():
    assert cpu_quant.use_direct(1) and cpu_quant.use_direct(cpu_quant.DIRECT_MAX_TOKENS)
    assert not cpu_quant.use_direct(cpu_quant.DIRECT_MAX_TOKENS + 1)


def test_self_check_passes_here():
    assert cpu_quant.self_check() is None


def test_the_native_build_vectorises_where_the_cpu_can():
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    want = 16 if "avx512f" in flags else 8 if {"avx2", "fma", "f16c"} <= set(flags) else 1
    assert cpu_quant.lanes() == want


@pytest.mark.parametrize("kind", KINDS)
def test_the_scalar_build_is_right(kind, monkeypatch):
    """Built for x86-64 without AVX2: every column through the portable loops."""
    assert cpu_quant.lanes(SCALAR) == 1
    scalar = native.function("quant_gemm", "quant_gemm_f32", *cpu_quant.SIGNATURE, SCALAR)
    monkeypatch.setattr(cpu_quant, "_kernel", lambda: scalar)
    for group, zeros, act_order in ((0, False, False), (7, True, False), (32, True, True)):
        w = weight(kind, (37, 75), group, zeros, act_order)
        for tokens in (1, 7):
            x = torch.randn(tokens, 75, generator=torch.Generator().manual_seed(tokens))
            assert_oracle(cpu_quant.quant_linear(x, w), x, w)
        assert torch.equal(cpu_quant.quant_linear(torch.eye(75), w), dequantize(w).T)


def test_the_avx512_build_compiles(tmp_path):
    """This machine may not run AVX-512; its path must still compile (to zmm code)."""
    probe = subprocess.run([native.compiler(), *AVX512, "-x", "c", "-c", "-", "-o",
                            str(tmp_path / "probe.o")], input="int x;", capture_output=True,
                           text=True)
    if probe.returncode:
        pytest.skip(f"{native.compiler()} does not take {' '.join(AVX512)}")
    native.build("quant_gemm", tmp_path / "quant_gemm.s", (*AVX512, "-S"))
    assert "zmm" in (tmp_path / "quant_gemm.s").read_text()


def test_the_cpu_engine_serves_the_kernel_once_checked(monkeypatch, caplog):
    assert backends.resolve_quant_backend("int4", CPU) == "cpu"
    assert backends.resolve_quant_backend(None, CPU) is None
    assert Backends(quant="cpu").quant_linear is cpu_quant.quant_linear
    assert Backends(quant="torch").quant_linear is dequant_linear
    monkeypatch.setattr(cpu_quant, "self_check", lambda: "RuntimeError: no C compiler")
    assert backends.resolve_quant_backend("fp8", CPU) == "torch"
    assert "no C compiler" in caplog.text
