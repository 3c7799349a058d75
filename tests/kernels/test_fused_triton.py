"""kernels/fused_triton.py under Triton's interpreter: residual add + RMSNorm, rotary and
SiLU-and-mul against their float64 oracles over a grid of shapes, strides and dtypes, and
against the torch layers' own ops (which round where the kernels round); the backend choice
(tests/engine/test_fused_elementwise.py runs an engine through them). The
interpreter truncates float32 to bfloat16 where a GPU rounds to nearest, so the checks that
are bit for bit here are float32's; the others hold to a unit in the last place."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loragw.engine.forward import backends
from loragw.engine.forward.elementwise import TORCH
from loragw.engine.layers.rotary import apply_rotary
from loragw.kernels import fused_triton as ft
from loragw.kernels.elementwise_reference import (
    oracle_add_rms_norm,
    oracle_rotary,
    oracle_silu_and_mul,
)

CPU = torch.device("cpu")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # else the interpreter
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = max(1.0, want.abs().max().item())
    error = (got.double() - want.double()).abs().max().item() / scale
    assert error <= TOLERANCE[dtype], (error, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,H", [(1, 64), (7, 100), (33, 512)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(dtype, T, H, with_delta):
    g = torch.Generator().manual_seed(T * H)
    x = (torch.randn(T, 3 * H, generator=g) * 3).to(DEVICE, dtype)[:, H:2 * H]  # strided rows
    delta = torch.randn(T, H, generator=g).to(DEVICE, dtype) if with_delta else None
    weight = torch.randn(H, generator=g).to(DEVICE, dtype)
    total, out = ft.add_rms_norm(x, delta, weight, 1e-5)
    want_total, want = oracle_add_rms_norm(x, delta, weight, 1e-5)
    close(total, want_total, dtype)
    close(out, want, dtype)
    s = x + delta if with_delta else x  # the torch layer's ops, in the dtype
    assert with_delta or total is x
    if dtype is torch.float32:
        assert torch.equal(total, s)
    close(total, s, dtype)
    sf = s.float()
    layer = weight * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    close(out, layer, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,heads,kv_heads,D", [(1, 4, 4, 8), (5, 8, 2, 64), (3, 6, 1, 128)])
def test_rotary_rounds_where_the_torch_layers_round(dtype, T, heads, kv_heads, D):
    g = torch.Generator().manual_seed(T + D)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * D, generator=g).to(DEVICE, dtype)
    q = qkv[:, :heads * D].view(T, heads, D)
    k = qkv[:, heads * D:(heads + kv_heads) * D].view(T, kv_heads, D)
    angles = torch.rand(T, 1, D // 2, generator=g).repeat(1, 1, 2) * 100
    cos, sin = angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)
    got = ft.rotary(q, k, cos, sin)
    for mine, theirs, x in zip(got, apply_rotary(q, k, cos, sin), (q, k)):  # torch's ops
        assert mine.is_contiguous() and mine.shape == x.shape
        close(mine, oracle_rotary(x, cos, sin), dtype)
        close(mine, theirs, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,inter", [(1, 24), (9, 1500)])
def test_silu_and_mul(dtype, T, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(T, 3 * inter, generator=g) * 4).to(DEVICE, dtype)[:, :2 * inter]
    out = ft.silu_and_mul(gate_up)
    assert out.shape == (T, inter) and out.is_contiguous()
    close(out, oracle_silu_and_mul(gate_up), dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    close(out, F.silu(gate) * up, dtype)


def test_empty_batches_launch_nothing():
    x = torch.empty(0, 64, device=DEVICE)
    assert ft.add_rms_norm(x, x, torch.ones(64, device=DEVICE), 1e-6)[1].shape == (0, 64)
    assert ft.silu_and_mul(torch.empty(0, 48, device=DEVICE)).shape == (0, 24)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's choice (the interpreter)")
def test_the_backend_choice():
    for dtype in DTYPES:
        assert ft.self_check(CPU, dtype) is None
    # forced on the CPU (the interpreter is set): serves; auto on the CPU keeps the C kernels
    assert backends.resolve_elementwise_backend("triton", CPU, torch.float32) == "triton"
    assert backends.resolve_elementwise_backend("auto", CPU, torch.bfloat16) == "cpu"
    assert backends.resolve_elementwise_backend("auto", CPU, torch.float16) == "torch"
    assert backends.Backends(elementwise="triton").fused.kernels is ft
    assert backends.Backends(elementwise="torch").fused is TORCH


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's choice (the interpreter)")
def test_a_broken_kernel_is_refused_when_forced(monkeypatch):
    monkeypatch.setattr(ft, "rotary", lambda q, k, cos, sin: (q * 2, k))
    with pytest.raises(ValueError, match="Triton norm, rotary and SiLU kernels fail"):
        backends.resolve_elementwise_backend("triton", CPU, torch.float32)
