"""kernels/cpu_linear.py against its meaning (x @ W.T + b in float64) over the shapes a decode
step and a prefill chunk give it, and the backend rule that picks it (engine/forward/backends.py)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from loragw.engine.forward import backends
from loragw.engine.layers.linear import Linear
from loragw.kernels import cpu_linear

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # of the output's largest magnitude


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 32, 129])
@pytest.mark.parametrize("shape", [(64, 48), (1376, 512), (512, 1376)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_the_product(dtype, rows, shape, bias):
    if not cpu_linear.supported(CPU, dtype):  # bfloat16 on a CPU without AVX-512: F.linear serves
        assert backends.resolve_linear_backend("auto", CPU, dtype) == "torch"
        with pytest.raises(ValueError, match="AVX-512"):
            backends.resolve_linear_backend("onednn", CPU, dtype)
        return
    g = torch.Generator().manual_seed(rows)
    out_features, in_features = shape
    w = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(rows, in_features, generator=g)
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    got = cpu_linear.packed_linear(x.to(dtype), cpu_linear.pack(w.to(dtype)),
                                   b.to(dtype) if bias else None)
    assert got.shape == (rows, out_features) and got.dtype == dtype
    error = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert error < TOLERANCE[dtype], error


def test_a_packed_projection_keeps_its_weight_and_its_answers():
    torch.manual_seed(0)
    linear = Linear(96, {"gate_proj": 80, "up_proj": 80})
    weight = torch.randn(160, 96)
    linear.weight.data.copy_(weight)
    x = torch.randn(5, 96)
    before = F.linear(x, weight)
    linear.prepack()
    assert torch.equal(linear.dense_weight(), weight)  # a layout, nothing lost
    assert "weight" not in dict(linear.named_parameters())  # the packed copy replaced it
    torch.testing.assert_close(linear(x), before, rtol=1e-5, atol=1e-5)


def test_the_backend_rule(monkeypatch, caplog):
    assert backends.resolve_linear_backend("torch", CPU, torch.float32) == "torch"
    assert backends.resolve_linear_backend("auto", CPU, torch.float32) == "onednn"
    assert backends.resolve_linear_backend("auto", CPU, torch.float16) == "torch"
    with pytest.raises(ValueError, match="oneDNN"):
        backends.resolve_linear_backend("onednn", torch.device("cuda"), torch.float32)
    monkeypatch.setattr(cpu_linear, "self_check", lambda dtype: "relative error 1e-1")
    with caplog.at_level(logging.WARNING):
        assert backends.resolve_linear_backend("auto", CPU, torch.float32) == "torch"
    assert "relative error" in caplog.text
    with pytest.raises(ValueError, match="fails its check"):
        backends.resolve_linear_backend("onednn", CPU, torch.float32)
