"""kernels/fused_triton.py's binaries for kernels/compile_targets.py's list: one builder per
launch site, argument for argument (tests/kernels/test_compile_targets.py checks them against the
real launches). Importing this module does not import Triton."""

from __future__ import annotations

from loragw.kernels.model_shapes import SHIPPED_MODELS
from loragw.kernels.variants import DTYPES, Variant, specialize
from loragw.kernels.variants import _pow2_at_least as pow2_at_least


def elementwise_variants(models=SHIPPED_MODELS, dtypes=DTYPES) -> list[Variant]:
    """kernels/fused_triton.py's launches for every model's widths x dtype: add + RMSNorm (the
    residual stream [T, H] contiguous, with and without the delta), rotary (q, k views of the
    qkv output) and SiLU-and-mul (the gate_up output [T, 2I])."""
    from loragw.kernels.fused_triton import BLOCK_I, rotary_warps, row_warps

    found: dict[Variant, None] = {}
    for model in models:
        proj = {p.name: p for p in model.projections}
        hidden, inter = proj["qkv_proj"].hidden, proj["gate_up_proj"].widths[0]
        n_q, n_k, head_dim = model.attention
        for dtype in dtypes:
            p = f"*{dtype}"
            block = pow2_at_least(hidden)
            for delta in (False, True):
                args = dict(x_ptr=p, delta_ptr=p, weight_ptr=p, sum_ptr=p, out_ptr=p, eps=0.5,
                            stride_x=hidden, stride_d=hidden if delta else 0, stride_s=hidden,
                            stride_o=hidden, H=hidden)
                found[specialize("_add_rms_norm_kernel", args, dict(HAS_DELTA=delta,
                                 BLOCK_H=block), row_warps(block))] = None
            row = (n_q + 2 * n_k) * head_dim
            args = dict(q_ptr=p, k_ptr=p, cos_ptr=p, sin_ptr=p, q_out_ptr=p, k_out_ptr=p,
                        stride_qt=row, stride_qh=head_dim, stride_kt=row, stride_kh=head_dim,
                        n_q=n_q, n_k=n_k)
            found[specialize("_rotary_kernel", args, dict(
                D=head_dim, BLOCK_D=pow2_at_least(head_dim // 2)), rotary_warps())] = None
            block = min(BLOCK_I, pow2_at_least(inter))
            args = dict(x_ptr=p, out_ptr=p, stride_x=2 * inter, stride_o=inter, inter=inter)
            found[specialize("_silu_and_mul_kernel", args, dict(BLOCK=block),
                             row_warps(block))] = None
    return list(found)
