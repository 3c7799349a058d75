"""A decoder layer's elementwise ops on a GPU as Triton kernels: residual add + RMSNorm, rotary
over q and k, and SiLU-and-mul, each one launch where the torch layers run a chain of 3-12 small
ops (each a kernel reading and writing the whole tensor). Inside the decode CUDA graphs they
are what vLLM's fused ops and inductor's fusions are there: fewer launches and passes over
memory. float32, bfloat16 and float16; kernels/cpu_fused.py is the CPU's C twin (float32).

Each rounds where the torch layers round, so in bf16/fp16 the outputs are the torch path's up to
the order of the norm's sum:
    add_rms_norm   s = x + d (to dtype);  out = w * (s * rsqrt(mean(s^2) + eps)).to(dtype)
    rotary         out = q * cos + rotate_half(q) * sin, each product and the sum to dtype
    silu_and_mul   out = silu(gate).to(dtype) * up,  gate_up = [gate | up] along the last dim

Grids, one program per:
    add_rms_norm   row                    (T,)            BLOCK_H = next power of 2 >= H
    rotary         (token, head) of q, k  (T, n_q + n_k)  BLOCK_D = next power of 2 >= D / 2
    silu_and_mul   (row, column tile)     (T, cdiv(I, BLOCK_I))

Serves once `self_check` passed on the device (engine/forward/backends.py). On the CPU only under
TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_I = 1024  # SiLU-and-mul columns per program
RUNTIME_ARGS: tuple[str, ...] = ()  # every argument is fixed per model: all may specialize


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, sum_ptr, out_ptr, eps,
                         stride_x, stride_d, stride_s, stride_o, H,
                         HAS_DELTA: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / H
    normed = (xf * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, n_q, n_k,
                   D: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    half = D // 2
    offs = tl.arange(0, BLOCK_D)
    mask = offs < half
    if h < n_q:
        src = q_ptr + t * stride_qt + h * stride_qh
        dst = q_out_ptr + (t * n_q + h) * D
    else:
        src = k_ptr + t * stride_kt + (h - n_q) * stride_kh
        dst = k_out_ptr + (t * n_k + h - n_q) * D
    dt = q_out_ptr.dtype.element_ty
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + offs, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * D + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * D + half + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * D + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * D + half + offs, mask=mask, other=0.0).to(tl.float32)
    # rotate_half(x) = [-x2 | x1]; every product rounded to the dtype, as torch's ops round
    first = (x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)
    second = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(dst + offs, first.to(dt), mask=mask)
    tl.store(dst + half + offs, second.to(dt), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dt = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(dt), mask=mask)


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor,
                 eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta, RMSNorm of it); x itself is the sum when delta is None. x, delta: [T, H],
    last dim contiguous (rows may be strided)   weight: [H]. Returns (sum, out), out new [T, H]."""
    T, H = x.shape
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    total = x if delta is None else torch.empty_like(out)
    if T:
        block = triton.next_power_of_2(H)
        _add_rms_norm_kernel[(T,)](
            x, x if delta is None else delta, weight, total, out, eps, x.stride(0),
            0 if delta is None else delta.stride(0), total.stride(0), out.stride(0), H,
            HAS_DELTA=delta is not None, BLOCK_H=block, num_warps=row_warps(block))
    return total, out


def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """q * cos + rotate_half(q) * sin, and the same for k. q: [T, n_q, D], k: [T, n_k, D], last
    dim contiguous (views of the qkv output)   cos, sin: [T, 1, D] contiguous, q's dtype.
    Returns new contiguous q, k."""
    T, n_q, D = q.shape
    n_k = k.shape[1]
    q_out = torch.empty(T, n_q, D, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, n_k, D, dtype=k.dtype, device=k.device)
    if T:
        _rotary_kernel[(T, n_q + n_k)](
            q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            n_q, n_k, D=D, BLOCK_D=triton.next_power_of_2(D // 2), num_warps=rotary_warps())
    return q_out, k_out


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of gate_up = [gate | up]: [T, 2I], last dim contiguous -> [T, I]."""
    T, width = gate_up.shape
    inter = width // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        block = min(BLOCK_I, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(T, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block,
            num_warps=row_warps(block))
    return out


def row_warps(block: int) -> int:
    """Warps for a row of `block` elements: ~8 elements a thread, 1 to 8 warps."""
    return max(1, min(8, block // 256))


def rotary_warps() -> int:
    """One warp per (token, head): a head is 64-128 elements."""
    return 1


def serves(x: Tensor) -> bool:
    """Whether these kernels take x (the layers' check, with the backend chosen): a float dtype
    they are written for, its last dim contiguous."""
    return x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.stride(-1) == 1


def self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why these kernels must not serve on `device` in `dtype` (None: they may): compiled, then
    compared with the same math in float64 on small random rows, strided as the layers pass
    them (kernels/elementwise_reference.py)."""
    from loragw.kernels.elementwise_reference import fused_elementwise_problem

    return fused_elementwise_problem(add_rms_norm, rotary, silu_and_mul, device, dtype)
