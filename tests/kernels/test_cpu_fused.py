"""kernels/cpu_fused.py: the C residual add + RMSNorm and rotary against their float64 math
over a grid of dtypes, shapes and strides, rotary bit-identical to the torch layers' ops in
float32 and bfloat16 (and bf16's residual sum too), and the layers running them only inside a
step whose backend is "cpu" (engine/forward/backends.py)."""

from __future__ import annotations

import pytest
import torch

from loragw.engine.forward import backends
from loragw.engine.forward.backends import Backends
from loragw.engine.forward.context import AttentionMetadata, ForwardContext, forward_context
from loragw.engine.forward.elementwise import TORCH
from loragw.engine.layers.norm import GemmaRMSNorm, RMSNorm
from loragw.engine.layers.rotary import apply_rotary
from loragw.kernels import cpu_fused

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]


def rms_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("T", [1, 9, 33])
@pytest.mark.parametrize("H", [8, 40, 512])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_is_the_reference(T, H, with_delta):
    g = torch.Generator().manual_seed(T * H)
    x = torch.randn(T, 3 * H, generator=g)[:, H:2 * H] * 3  # strided rows, as a split gives
    delta = torch.randn(T, H, generator=g) if with_delta else None
    weight = torch.randn(H, generator=g)
    total, out = cpu_fused.add_rms_norm(x, delta, weight, 1e-5)
    want_total = x.double() + (delta.double() if with_delta else 0)
    assert (total.double() - want_total).abs().max() <= 1e-6
    assert out.is_contiguous() and out.shape == (T, H)
    torch.testing.assert_close(out.double(), rms_reference(want_total, weight, 1e-5),
                               rtol=2e-6, atol=2e-6)
    if not with_delta:
        assert total is x  # the residual stream is the input itself


@pytest.mark.parametrize("T", [1, 9, 33])
@pytest.mark.parametrize("H", [8, 40, 512, 4096])
@pytest.mark.parametrize("with_delta", [False, True])
def test_bf16_add_rms_norm_rounds_where_torch_does(T, H, with_delta):
    """The sum is torch's bf16 x + delta bit for bit; out is float64's math on the bf16 inputs
    within its two roundings (the normalized row's and the product's: 2^-8 relative each) and
    within one bf16 step of torch's (its mean sums in another order)."""
    g = torch.Generator().manual_seed(T * H)
    x = (torch.randn(T, 3 * H, generator=g) * 3).bfloat16()[:, H:2 * H]
    delta = torch.randn(T, H, generator=g).bfloat16() if with_delta else None
    weight = torch.randn(H, generator=g).bfloat16()
    total, out = cpu_fused.add_rms_norm(x, delta, weight, 1e-5)
    want_total, want_out = TORCH.add_rms_norm(x, delta, weight, 1e-5)
    assert total.dtype == out.dtype == torch.bfloat16 and torch.equal(total, want_total)
    want = rms_reference(total, weight, 1e-5)
    assert ((out.double() - want).abs() <= 2.01 * 2**-8 * want.abs() + 1e-30).all()
    steps = (out.float() - want_out.float()).abs() / want_out.float().abs().clamp_min(1e-30)
    assert (steps <= 2**-7).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T", [1, 5, 40])
@pytest.mark.parametrize("heads,kv_heads,D", [(4, 4, 8), (8, 2, 64), (6, 1, 128)])
def test_rotary_is_the_torch_layers_bit_for_bit(T, heads, kv_heads, D, dtype):
    g = torch.Generator().manual_seed(T + D)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * D, generator=g).to(dtype)
    q = qkv[:, :heads * D].view(T, heads, D)
    k = qkv[:, heads * D:(heads + kv_heads) * D].view(T, kv_heads, D)
    angles = torch.rand(T, 1, D // 2, generator=g).repeat(1, 1, 2) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = cpu_fused.rotary(q, k, cos, sin)
    for mine, theirs in zip(got, apply_rotary(q, k, cos, sin)):  # no step: torch's ops
        assert mine.dtype == dtype and torch.equal(mine, theirs)


def test_layers_use_the_kernels_only_in_a_cpu_step(monkeypatch):
    calls = []
    real = cpu_fused.add_rms_norm
    monkeypatch.setattr(cpu_fused, "add_rms_norm", lambda *a: calls.append(a) or real(*a))
    norm, gemma = RMSNorm(16, 1e-6), GemmaRMSNorm(16, 1e-6)
    for module in (norm, gemma):
        module.weight.data = torch.randn(16)
    x, delta = torch.randn(3, 16), torch.randn(3, 16)
    outside = norm(x)
    assert not calls
    meta = AttentionMetadata(torch.zeros(3, dtype=torch.long), 0, None, None, None, None,
                             [], [], [], [])
    with forward_context(ForwardContext(meta, backends=Backends(elementwise="cpu"))):
        inside = norm(x)
        total, normed = norm.add(x, delta)
        gemma(x), gemma.add(x, delta)  # Gemma's formula is not the kernel's
        head_norm = RMSNorm(8, 1e-6)
        head_norm.weight.data = torch.randn(8)
        head_norm(x.view(3, 2, 8))  # a per-head q/k norm [T, n, D] keeps torch's ops
    assert len(calls) == 2
    torch.testing.assert_close(inside, outside, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(total, x + delta, rtol=0, atol=0)
    torch.testing.assert_close(normed, norm(x + delta), rtol=1e-6, atol=1e-6)


def test_auto_picks_the_kernels_on_a_float32_or_bfloat16_cpu_engine():
    for dtype in DTYPES:
        assert cpu_fused.self_check(dtype) is None
        assert backends.resolve_elementwise_backend("auto", CPU, dtype) == "cpu"
    assert backends.resolve_elementwise_backend("auto", CPU, torch.float16) == "torch"
    assert backends.resolve_elementwise_backend("torch", CPU, torch.float32) == "torch"
    assert cpu_fused.self_check(torch.float16) is not None
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU engine"):
        backends.resolve_elementwise_backend("cpu", CPU, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_kernel_that_cannot_build_leaves_torch_serving(monkeypatch, caplog, dtype):
    monkeypatch.setattr(cpu_fused, "_library", lambda dtype: (_ for _ in ()).throw(
        RuntimeError("no C compiler (cc or $CC) to build the fused_ops kernel")))
    assert backends.resolve_elementwise_backend("auto", CPU, dtype) == "torch"
    assert "no C compiler" in caplog.text
    with pytest.raises(ValueError, match="no C compiler"):
        backends.resolve_elementwise_backend("cpu", CPU, dtype)
