"""A dense projection on the CPU through oneDNN with its weight packed once, at load.

    packed_linear(x, pack(W), b) = x @ W.T + b
    x: [T, I] (float32 | bfloat16)   W: [O, I] (same dtype)   b: [O] or None   out: [T, O]

torch's F.linear hands a decode step's small GEMMs (T = the batch) to MKL's sgemm, which
repacks W on every call; oneDNN's inner-product primitive reads a W laid out for it once
(`torch.ops.mkldnn._reorder_linear_weight`, as inductor's CPU freezing does), and at T of 8 to
128 runs the bench Llama's projections 1.5-3x faster on an AVX-512 CPU
(benchmarks/RESULTS.md, "The decode step at the roofline"); on small weights its fixed cost
per call loses (`worth_packing`). The sum runs in another order than MKL's, so results differ in
the last bits (float32: ~1e-7 relative); `self_check` compares against float64 at start-up.
"""

from __future__ import annotations

import torch

PACK_BATCH_HINT = 32  # the batch oneDNN lays W out for; any T is computed correctly
# oneDNN's call costs ~15 us more than MKL's: below about 512 x 512 weights (2 threads, T = 1
# to 32) F.linear is as fast or faster, so `auto` packs only projections this large.
PACK_MIN_ELEMENTS = 512 * 512


def worth_packing(out_features: int, in_features: int) -> bool:
    return out_features * in_features >= PACK_MIN_ELEMENTS


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's bfloat16 GEMM needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; float32 any x86."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16
                                      and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor, batch_hint: int = PACK_BATCH_HINT) -> torch.Tensor:
    """W [O, I] as oneDNN's opaque tensor (same numel and dtype)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [T, I] -> [T, O]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def self_check(dtype: torch.dtype) -> str | None:
    """None if the packed GEMM matches float64 on small random shapes (batch 1, 5 and 33,
    with a bias), else what went wrong."""
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    g = torch.Generator().manual_seed(0)
    try:
        w = torch.randn(96, 80, generator=g)
        b = torch.randn(96, generator=g)
        packed = pack(w.to(dtype))
        for rows in (1, 5, 33):
            x = torch.randn(rows, 80, generator=g)
            want = x.double() @ w.double().T + b.double()
            got = packed_linear(x.to(dtype), packed, b.to(dtype)).double()
            error = ((got - want).abs().max() / want.abs().max()).item()
            if not error <= tolerance:
                return f"relative error {error:.2e} > {tolerance:.0e} at batch {rows}"
    except (RuntimeError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
