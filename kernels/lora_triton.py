"""Segmented-gather LoRA kernels in Triton: one kernel family for prefill and decode.

Layout. Tokens are grouped by adapter slot through `meta.sorted_token_ids` (an index: x never
moves) and each slot's group is cut into tiles of `meta.block_m` tokens. One program owns one
tile x one block of outputs x one output slice; it reads its slot's weights once for the
whole tile. Weights are stacked ([n, S, R, H] and [S, O, R]) and addressed by integer offsets,
not pointer tables, so the same code runs under the Triton interpreter.

Grid (fixed: it depends only on T, S, n_slices, R, the widths and the block sizes, never on
which slots the tokens use, so a step can be captured in a CUDA graph and replayed with new
metadata):
    shrink: (NT * cdiv(R, BLOCK_R), split_k, n_slices)
    expand: (NT, cdiv(max slice width, BLOCK_N), n_slices)
    NT = num_tiles_bound(T, S, BLOCK_M) = cdiv(T + min(S, T) * (BLOCK_M - 1), BLOCK_M)
Programs whose tile is empty, whose slot has rank 0 for their slice, whose rank block starts
past the slot's rank, or whose output block lies past their slice's width return at once.
Tokens with slot -1 belong to no tile and cost nothing. The expand kernel's reduction loop
runs to the slot's own rank, so a rank-8 adapter in a rank-64 pool does rank-8 work.

Why one family and not an SGMV (prefill) + BGMV (decode) pair: decode LoRA is memory-bound
(about 1 FLOP per byte when every token has its own adapter), and a program reads its slot's
weights exactly once per tile. With distinct adapters a 16-row tile holds one token: the MMA
wastes 15/16 of its lanes but reads exactly the bytes a per-token BGMV reads, and those bytes
are the cost. When tokens share adapters (uniform, zipf, identical traffic) the tile reads a
weight once per 16 tokens where BGMV reads it once per token. Prefill is the same kernel with
64-row tiles. One family means one set of tests and one graph-capture surface. The risk is the
distinct-adapter decode case, where a GEMV kernel may reach higher bandwidth than a padded
MMA; benchmarks/bench_kernels_gpu.py reports achieved bandwidth as a fraction of
device-to-device copy for distinct and identical traffic, and `--block-m 1` runs these same
kernels as a BGMV (one token per program; tiles under 16 rows sum products on the CUDA cores
instead of `tl.dot`), so the choice can be revisited with numbers: a switch would be a named
rule beside `tile_m_for` in kernels/meta.py.

Split-K: decode shrink has few tiles (T=1: one) and a long reduction (H = 4096..14336), so
the H loop is split across split_k programs that atomically add fp32 partials into y (which
the caller zeroes); split_k is a runtime count (ATOMIC: whether it is > 1), like every other
per-step argument (SHRINK_RUNTIME_ARGS), so one binary serves every step. Accumulation is fp32
throughout.

CUDA graphs: call once before capturing (compiles the kernels and caches the slice-offset
tensor), capture with a static LoRAMeta, then `make_lora_meta(..., out=static_meta)` per step
(engine/runner/model_runner.py does). Under TRITON_INTERPRET=1 operands are cast
to fp32 before `tl.dot` (the interpreter's bf16 dot returns garbage).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import pairwise

import torch
import triton
import triton.language as tl
from torch import Tensor

from loragw.kernels.meta import DECODE_BLOCK_M, LoRAMeta

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read once, as @triton.jit does
SHRINK_TARGET_PROGRAMS = 512   # ~4 waves of an H100/H200's 132 SMs
MAX_SPLIT_K = 16
# Arguments whose value changes with the step (token count, the packed meta's offsets, the
# split count) or the config (slots): never specialized (== 1, 16-divisible), so one binary
# serves every step instead of a JIT compile mid-serving when a step first hits another class.
_META_ARGS = ("T", "S", "sorted_ids_ptr", "tile_slots_ptr", "tile_starts_ptr", "tile_lens_ptr")
SHRINK_RUNTIME_ARGS = (*_META_ARGS, "split_k")
EXPAND_RUNTIME_ARGS = _META_ARGS


@triton.jit(do_not_specialize=SHRINK_RUNTIME_ARGS)
def _shrink_kernel(x_ptr, a_ptr, y_ptr, ranks_ptr, sorted_ids_ptr, tile_slots_ptr,
                   tile_starts_ptr, tile_lens_ptr, T, H, S, R, stride_xt, stride_xh, split_k,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   ATOMIC: tl.constexpr, NUM_R_BLOCKS: tl.constexpr, CAST_FP32: tl.constexpr,
                   PRECISION: tl.constexpr, USE_DOT: tl.constexpr):
    """y[i, t, :r] (+)= x[t] @ lora_a[i, slot(t), :r].T for the tokens of one tile.

    x: [T, H] (fp32/fp16/bf16)   a: [n, S, R, H] contiguous (x.dtype)   y: [n, T, R] fp32, zeroed
    ranks: [n, S] int32   sorted_ids: [T] int32   tile_slots/starts/lens: [NT] int32
    """
    tile = tl.program_id(0) // NUM_R_BLOCKS
    r0 = (tl.program_id(0) % NUM_R_BLOCKS) * BLOCK_R
    pid_k = tl.program_id(1)
    sl = tl.program_id(2)
    slot = tl.load(tile_slots_ptr + tile)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + sl * S + slot)
    if r0 >= rank:
        return
    start = tl.load(tile_starts_ptr + tile)
    length = tl.load(tile_lens_ptr + tile)

    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    tok = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)  # [BM]
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    a_base = a_ptr + (sl * S + slot).to(tl.int64) * R * H

    k_span = tl.cdiv(H, split_k * BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    k_hi = tl.minimum(k_lo + k_span, H)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        xt = tl.load(x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xh,
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)       # [BM, BK]
        at = tl.load(a_base + offs_r[None, :] * H + offs_k[:, None],
                     mask=k_mask[:, None] & r_mask[None, :], other=0.0)       # [BK, BR]
        if not USE_DOT:  # tiles under 16 rows (GEMV-like): products summed on the CUDA cores
            acc += tl.sum(xt.to(tl.float32)[:, :, None] * at.to(tl.float32)[None, :, :], axis=1)
        elif CAST_FP32:
            acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(xt, at, input_precision=PRECISION)

    y_ptrs = y_ptr + sl * T * R + tok[:, None] * R + offs_r[None, :]
    mask = m_mask[:, None] & r_mask[None, :]
    if not ATOMIC:  # split_k == 1: the only writer
        tl.store(y_ptrs, acc, mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask)


@triton.jit(do_not_specialize=EXPAND_RUNTIME_ARGS)
def _expand_kernel(y_ptr, b_ptr, out_ptr, ranks_ptr, scales_ptr, offsets_ptr, sorted_ids_ptr,
                   tile_slots_ptr, tile_starts_ptr, tile_lens_ptr, T, S, R, O_total, stride_ot,
                   stride_oo, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, USE_DOT: tl.constexpr):
    """out[t, o[i] + n] += scales[i, s] * y[i, t, :r] @ lora_b[s, o[i] + n, :r].T for one tile.

    y: [n, T, R] fp32   b: [S, O, R] contiguous (out.dtype)   out: [T, O] (fp32/fp16/bf16)
    ranks: [n, S] int32   scales: [n, S] fp32   offsets: [n+1] int32   tiles as in shrink
    """
    tile = tl.program_id(0)
    sl = tl.program_id(2)
    slot = tl.load(tile_slots_ptr + tile)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + sl * S + slot)
    if rank == 0:
        return
    n_lo = tl.load(offsets_ptr + sl) + tl.program_id(1) * BLOCK_N
    n_hi = tl.load(offsets_ptr + sl + 1)
    if n_lo >= n_hi:
        return
    start = tl.load(tile_starts_ptr + tile)
    length = tl.load(tile_lens_ptr + tile)

    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    tok = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)  # [BM]
    offs_n = n_lo + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_hi
    b_base = b_ptr + slot.to(tl.int64) * O_total * R
    y_base = y_ptr + sl * T * R + tok * R                                      # [BM]

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        yt = tl.load(y_base[:, None] + offs_r[None, :],
                     mask=m_mask[:, None] & r_mask[None, :], other=0.0)       # [BM, BR] fp32
        bt = tl.load(b_base + offs_n[None, :] * R + offs_r[:, None],
                     mask=r_mask[:, None] & n_mask[None, :], other=0.0)       # [BR, BN]
        if USE_DOT:
            acc += tl.dot(yt, bt.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.sum(yt[:, :, None] * bt.to(tl.float32)[None, :, :], axis=1)
    acc *= tl.load(scales_ptr + sl * S + slot)

    o_ptrs = out_ptr + tok[:, None] * stride_ot + offs_n[None, :] * stride_oo
    mask = m_mask[:, None] & n_mask[None, :]
    old = tl.load(o_ptrs, mask=mask, other=0.0)
    tl.store(o_ptrs, (old.to(tl.float32) + acc).to(old.dtype), mask=mask)


@dataclass(frozen=True, slots=True)
class ShrinkConfig:
    block_r: int   # ranks per program (>= 16: tl.dot's minimum)
    block_k: int   # input features per loop step
    split_k: int   # programs sharing one tile's H loop (atomic adds when > 1)
    num_warps: int = 4


@dataclass(frozen=True, slots=True)
class ExpandConfig:
    block_n: int   # output features per program
    block_r: int   # ranks per loop step
    num_warps: int = 4


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def shrink_config(num_tiles: int, n_slices: int, max_rank: int, hidden: int, block_m: int,
                  interpret: bool = INTERPRET) -> ShrinkConfig:
    """Decode tiles (block_m <= 16) take 16-rank blocks so a small adapter in a big pool skips the
    rest; split-K until the grid has ~SHRINK_TARGET_PROGRAMS programs. The interpreter runs one
    program at a time, so there every block is as large as the problem."""
    if interpret:
        return ShrinkConfig(block_r=_pow2(max_rank, 16, 128), block_k=_pow2(hidden, 16, 512), split_k=1)
    decode = block_m <= DECODE_BLOCK_M
    block_r = 16 if decode else _pow2(max_rank, 16, 64)
    block_k = 256 if decode else 128
    programs = num_tiles * triton.cdiv(max_rank, block_r) * n_slices
    split_k = 1
    while (programs * split_k < SHRINK_TARGET_PROGRAMS and split_k < MAX_SPLIT_K
           and 2 * split_k * block_k <= hidden):
        split_k *= 2
    return ShrinkConfig(block_r=block_r, block_k=block_k, split_k=split_k)


def expand_config(max_width: int, max_rank: int, block_m: int,
                  interpret: bool = INTERPRET) -> ExpandConfig:
    """128-wide output blocks; rank steps of 16 for decode tiles, up to 64 for prefill tiles.
    Prefill tiles take 8 warps: a 64 x 128 tile on 4 warps spills on sm_80 and sm_90
    (benchmarks/compile_targets.md)."""
    if interpret:
        return ExpandConfig(block_n=_pow2(max_width, 16, 1024), block_r=_pow2(max_rank, 16, 128))
    decode = block_m <= DECODE_BLOCK_M
    block_r = 16 if decode else _pow2(max_rank, 16, 64)
    return ExpandConfig(block_n=128, block_r=block_r, num_warps=4 if decode else 8)


def shrink_grid(num_tiles: int, n_slices: int, max_rank: int, cfg: ShrinkConfig) -> tuple[int, int, int]:
    return (num_tiles * triton.cdiv(max_rank, cfg.block_r), cfg.split_k, n_slices)


def expand_grid(num_tiles: int, n_slices: int, max_width: int, cfg: ExpandConfig) -> tuple[int, int, int]:
    return (num_tiles, triton.cdiv(max_width, cfg.block_n), n_slices)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 models get fp32 products


_offsets_cache: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}


def _offsets_tensor(slice_offsets: tuple[int, ...], device: torch.device) -> Tensor:
    key = (tuple(slice_offsets), device)
    if key not in _offsets_cache:
        _offsets_cache[key] = torch.tensor(key[0], dtype=torch.int32, device=device)
    return _offsets_cache[key]


def lora_shrink(x: Tensor, lora_a: Tensor, ranks: Tensor, meta: LoRAMeta, y: Tensor,
                config: ShrinkConfig | None = None) -> None:
    """y[i, t, :r] = x[t] @ lora_a[i, slot(t), :r].T. x: [T, H]   lora_a: [n, S, R, H]
    ranks: [n, S] int32   y: [n, T, R] fp32, zero (written where the slot has rank > 0)."""
    n, S, R, H = lora_a.shape
    T, nt = x.shape[0], meta.tile_slots.shape[0]
    cfg = config or shrink_config(nt, n, R, H, meta.block_m)
    _shrink_kernel[shrink_grid(nt, n, R, cfg)](
        x, lora_a, y, ranks, meta.sorted_token_ids, meta.tile_slots, meta.tile_starts,
        meta.tile_lens, T, H, S, R, x.stride(0), x.stride(1), cfg.split_k,
        BLOCK_M=meta.block_m, BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k, ATOMIC=cfg.split_k > 1,
        NUM_R_BLOCKS=triton.cdiv(R, cfg.block_r), CAST_FP32=INTERPRET,
        PRECISION=_precision(x.dtype), USE_DOT=meta.block_m >= 16, num_warps=cfg.num_warps)


def lora_expand(out: Tensor, y: Tensor, lora_b: Tensor, ranks: Tensor, scales: Tensor,
                slice_offsets: tuple[int, ...], meta: LoRAMeta,
                config: ExpandConfig | None = None) -> None:
    """out[t, o[i]:o[i+1]] += scales[i, slot(t)] * y[i, t, :r] @ lora_b[slot(t), o[i]:o[i+1], :r].T
    out: [T, O]   y: [n, T, R] fp32   lora_b: [S, O, R]   ranks: [n, S] int32   scales: [n, S] fp32"""
    S, O_total, R = lora_b.shape
    n, T, nt = y.shape[0], out.shape[0], meta.tile_slots.shape[0]
    max_width = max(hi - lo for lo, hi in pairwise(slice_offsets))
    cfg = config or expand_config(max_width, R, meta.block_m)
    _expand_kernel[expand_grid(nt, n, max_width, cfg)](
        y, lora_b, out, ranks, scales, _offsets_tensor(slice_offsets, out.device),
        meta.sorted_token_ids, meta.tile_slots, meta.tile_starts, meta.tile_lens,
        T, S, R, O_total, out.stride(0), out.stride(1),
        BLOCK_M=meta.block_m, BLOCK_N=cfg.block_n, BLOCK_R=cfg.block_r,
        PRECISION=_precision(out.dtype), USE_DOT=meta.block_m >= 16, num_warps=cfg.num_warps)
