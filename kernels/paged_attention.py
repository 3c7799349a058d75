"""Paged-attention decode in Triton: flash-decoding that reads K/V in place from the paged cache.

Meaning (one query token per sequence b; GQA group size G = n_heads / n_kv_heads; query head h
reads kv head h // G, as SDPA's enable_gqa does):
    out[b, h] = softmax(cap(scale * q[b, h] @ K[b, :, h // G].T)) @ V[b, :, h // G]
    K[b, t] = k_cache[block_tables[b, t // block_size], t % block_size]
              for context_lens[b] - window <= t < context_lens[b]
    cap(s) = softcap * tanh(s / softcap)   (identity when softcap is None; window None: all t)
kernels/reference.py `oracle_paged_attention` is that line in float64. The window (Mistral's,
Gemma's sliding layers) starts the tile loop at the window's first tile and masks the rest of
that tile, so table entries before the window (freed blocks) are never read; both are runtime
arguments (0 = off), one binary for every model.

Layout. The cache is [num_blocks, block_size, n_kv_heads, D] (the engine's, unchanged); each
sequence's row of block_tables names its blocks in order. A program walks its share of one
sequence's context in tiles of BLOCK_N tokens; for every token of a tile it reads the table
entry (t // block_size), so a tile may span several cache blocks and block_size need not be a
power of two nor divide BLOCK_N. Nothing is gathered into a padded copy: each K/V byte of the
context is read once, straight from its block (the torch path reads it three times: gather,
write, SDPA). Tokens at or past the context length are masked out of every load, so unused
blocks, padding entries of the table (0) and stale slots of the last block are never read.

Grid (fixed: depends only on B, n_kv_heads and the config, never on the context lengths or the
tables, so a decode step can be captured in a CUDA graph and replayed with new tables/lengths):
    attention: (B, n_kv_heads, NUM_SPLITS)      reduce (NUM_SPLITS > 1 only): (B, n_heads)
One program owns one (sequence, kv head, split): all G query heads of that kv head at once,
as the rows of a [BLOCK_H, D] query tile (BLOCK_H = max(16, next_pow2(G)): tl.dot's minimum),
so each K/V tile is loaded once for the whole group and scored with tl.dot (tensor cores; the
padding rows are wasted FLOPs, but decode attention is memory-bound). Why (seq, kv_head) and not
(seq, q_head) as vLLM's v1 kernel: with G = 4 (Llama-3-8B) a per-query-head grid reads every
K/V byte four times. Why a split axis: B * n_kv_heads is small (8 programs per sequence for
Llama-3-8B), so at small batches and long contexts the GPU would idle; flash-decoding splits each
sequence's context into NUM_SPLITS interleaved sets of whole tiles (split s of n tiles takes
tiles s, s + S, ... < n: no division by the runtime split count, which ptxas makes a call; the
KV blocks are scattered anyway): a fixed count, not vLLM v2's fixed partition size, so the grid
does not grow with the longest context. Splits past a short context leave an empty partial. `decode_config` picks NUM_SPLITS from the batch size,
kv heads and SM count (a named rule, `num_splits_for`).

Softmax: online, in fp32, in the log2 domain (scores scaled by scale * log2(e), exp2). Each
split keeps (m, l, acc); NUM_SPLITS == 1 writes acc / l directly, otherwise the partials
(fp32 [B, n_heads, S, D] and [B, n_heads, S] x 2) are merged by a second kernel:
    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,   M = max_s m_s.
A sequence with context length 0 (a padding row of a captured batch) gets zeros.

Precision: Q K^T accumulates in fp32 (`ieee` for fp32 caches); P is rounded to the cache dtype
before P V (as flash-attention does) and accumulates in fp32. Caches fp32, fp16, bf16; q and
out have the cache's dtype. Under TRITON_INTERPRET=1 the dot operands are cast to fp32 (the
interpreter's bf16 dot returns garbage) and there is one split with 128-token tiles (it runs one
program at a time).
"""

from __future__ import annotations

import os
from functools import cache

import torch
import triton
import triton.language as tl
from torch import Tensor

# re-exported: callers know the decode config from here
from loragw.kernels.decode_config import (  # noqa: F401
    DECODE_TARGET_PROGRAMS,
    MAX_SPLITS,
    PROGRAMS_PER_SM,
    DecodeConfig,
    decode_config,
    decode_grid,
    num_splits_for,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read once, as @triton.jit does
LOG2E = 1.4426950408889634
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# Per-step arguments (the tables' width and offset in the engine's packed buffer, the split
# count) are never specialized: one binary per head shape serves every step.
DECODE_RUNTIME_ARGS = ("tables_ptr", "stride_tb", "num_splits", "window")
REDUCE_RUNTIME_ARGS = ("num_splits",)


@triton.jit(do_not_specialize=DECODE_RUNTIME_ARGS)
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, lens_ptr, out_ptr,
                   part_acc_ptr, part_m_ptr, part_l_ptr, scale_log2, softcap_log2, window,
                   stride_qb, stride_qh, stride_cb, stride_ct, stride_ch, stride_tb,
                   stride_ob, stride_oh, num_splits,
                   GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   SPLIT: tl.constexpr, CAST_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """The G query heads of kv head `kvh` of sequence `b` over split `split` of its context.

    q: [B, n_heads, D]   k_cache, v_cache: [N, block_size, n_kv, D] (q.dtype, same strides)
    tables: [B, W] int32   lens: [B] int32   out: [B, n_heads, D] (q.dtype), num_splits == 1
    part_acc: [B, n_heads, num_splits, D] fp32   part_m, part_l: [B, n_heads, num_splits] fp32
    SPLIT: num_splits > 1 (then the partials are written, for the reduce kernel)
    softcap_log2: softcap * log2(e), 0.0 = no cap   window: keys [ctx - window, ctx), 0 = all
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    num_tiles = tl.cdiv(ctx, BLOCK_N)
    lo = 0  # the first key the query sees
    if window > 0:
        lo = tl.maximum(ctx - window, 0)
    first_tile = lo // BLOCK_N

    offs_g = tl.arange(0, BLOCK_H)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g                                               # [BH]
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    hd_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=hd_mask, other=0.0)                                       # [BH, BD]
    if CAST_FP32:
        q = q.to(tl.float32)

    table_row = tables_ptr + b.to(tl.int64) * stride_tb
    head_offset = kvh.to(tl.int64) * stride_ch
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for tile in range(first_tile + split, num_tiles, num_splits):  # each holds >= 1 key it sees
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = (offs_n < ctx) & (offs_n >= lo)
        block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = block * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct + head_offset  # [BN]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BN, BD]
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BN, BD]
        if CAST_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2     # [BH, BN] fp32
        if softcap_log2 > 0:  # cap * tanh(s / cap) in the log2 domain; tanh(x) = 2 sigmoid(2x) - 1
            s = softcap_log2 * (2.0 * tl.sigmoid(2.0 * s / softcap_log2) - 1.0)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))                             # finite
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])                                        # [BH, BN]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(v.dtype)
        if CAST_FP32:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)   # [BH, BD]
        m_i = m_new

    if not SPLIT:
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
                 + offs_d[None, :], result.to(out_ptr.dtype.element_ty), mask=hd_mask)
    else:
        row_s = (b.to(tl.int64) * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [BH]
        tl.store(part_acc_ptr + row_s[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=hd_mask)
        tl.store(part_m_ptr + row_s, m_i, mask=g_mask)
        tl.store(part_l_ptr + row_s, l_i, mask=g_mask)


@triton.jit(do_not_specialize=REDUCE_RUNTIME_ARGS)
def _reduce_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, stride_ob, stride_oh,
                   num_splits, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """out[b, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the splits of (b, h).

    part_acc: [B, n_heads, num_splits, D] fp32   part_m, part_l: [B, n_heads, num_splits] fp32
    out: [B, n_heads, D]
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = (b.to(tl.int64) * tl.num_programs(1) + h) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_s = tl.load(part_m_ptr + row + offs_s, mask=s_mask, other=float("-inf"))  # [BS]
    l_s = tl.load(part_l_ptr + row + offs_s, mask=s_mask, other=0.0)
    m_max = tl.max(m_s, axis=0)
    w = tl.exp2(m_s - tl.where(m_max > float("-inf"), m_max, 0.0))            # empty splits: 0
    acc = tl.load(part_acc_ptr + (row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)          # [BS, BD]
    num = tl.sum(w[:, None] * acc, axis=0)                                     # [BD]
    den = tl.sum(w * l_s, axis=0)
    result = num / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
             result.to(out_ptr.dtype.element_ty), mask=d_mask)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 caches get fp32 products


def paged_attention_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                           context_lens: Tensor, scale: float, out: Tensor | None = None,
                           config: DecodeConfig | None = None, sliding_window: int | None = None,
                           softcap: float | None = None) -> Tensor:
    """out[b, h] = softmax(cap(scale * q[b, h] @ K[b, :, h // G].T)) @ V[b, :, h // G], K/V
    read through block_tables[b], the last `sliding_window` (default: all) of context_lens[b]
    (see the module docstring).

    q: [B, n_heads, D] (last dim contiguous)   k_cache, v_cache: [N, block_size, n_kv, D]
    (q.dtype: fp32/fp16/bf16, last dim contiguous, same strides)   block_tables: [B, W] int32
    (W * block_size >= max context; entries past a context are never read)
    context_lens: [B] int32   out: [B, n_heads, D] (q.dtype), written; allocated when None.
    Returns out.
    """
    B, n_heads, D = q.shape
    _, block_size, n_kv, D_cache = k_cache.shape
    assert q.dtype in DTYPES, f"q must be one of {DTYPES}, got {q.dtype}"
    assert k_cache.dtype == v_cache.dtype == q.dtype, (
        f"q, k_cache, v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    assert D_cache == D and n_heads % n_kv == 0, (
        f"q [B, {n_heads}, {D}] does not fit a cache of {n_kv} kv heads x {D_cache}")
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == B, (
        f"block_tables must be [{B}, max_blocks] int32, got {tuple(block_tables.shape)} {block_tables.dtype}")
    assert context_lens.dtype == torch.int32 and context_lens.shape == (B,), (
        f"context_lens must be [{B}] int32, got {tuple(context_lens.shape)} {context_lens.dtype}")
    assert block_tables.stride(1) == 1 and context_lens.is_contiguous()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if B == 0:
        return out
    cfg = config or decode_config(B, n_kv, D, q.device)
    group = n_heads // n_kv
    block_d = max(16, triton.next_power_of_2(D))
    split = cfg.num_splits > 1
    part_acc = torch.empty((B, n_heads, cfg.num_splits, D) if split else (1,), dtype=torch.float32,
                           device=q.device)
    part_m = torch.empty((B, n_heads, cfg.num_splits) if split else (1,), dtype=torch.float32,
                         device=q.device)
    part_l = torch.empty_like(part_m)
    _decode_kernel[decode_grid(B, n_kv, cfg)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_m, part_l,
        scale * LOG2E, (softcap or 0.0) * LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1), cfg.num_splits,
        GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=D,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg.block_n, BLOCK_D=block_d,
        SPLIT=split, CAST_FP32=INTERPRET, PRECISION=_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split:
        _reduce_kernel[(B, n_heads)](
            part_acc, part_m, part_l, out, out.stride(0), out.stride(1), cfg.num_splits,
            HEAD_DIM=D, BLOCK_S=max(2, triton.next_power_of_2(cfg.num_splits)),
            BLOCK_D=block_d, num_warps=4)
    return out


@cache
def self_check(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
               head_dim: int, sliding_window: int | None = None,
               softcap: float | None = None) -> str | None:
    """Why the kernel must not serve these shapes on `device`, or None when it may
    (kernels.reference.paged_decode_problem). Compiles the kernel."""
    from loragw.kernels.reference import paged_decode_problem

    return paged_decode_problem(paged_attention_decode, device, dtype, num_heads, num_kv_heads,
                                head_dim, sliding_window, softcap,
                                tolerance=1e-3 if dtype == torch.float32 else 3e-2)
