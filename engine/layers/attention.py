"""Attention over the paged KV cache.

New keys/values are scattered into the cache by slot; queries then read their whole context
back through the sequence's block table. Prefill rows run one SDPA call per sequence, causal
within the chunk and full over the cached prefix. Decode rows (one query each) run on the
kernel the engine chose at start-up (ForwardContext.backends.decode_attention, engine/forward/backends.py):

    triton  kernels/paged_attention.py: one flash-decoding kernel reads each K/V block in place
            through the padded block tables (AttentionMetadata.decode_block_tables and
            decode_context_lens). The default on CUDA.
    torch   gather each decode row's whole blocks (decode_block_ids) into a padded
            [B, L, n_kv, D] copy, then one batched SDPA call under decode_mask. The default on
            CPU (the Triton interpreter is far too slow to serve with), where the rows go in
            chunks (decode_chunks: by context length, each gather small enough to be read
            back from the cache; sliding-window layers keep the one batched call).

Two per-layer options (Mistral / Qwen2 sliding windows, Gemma 2 / 3):
    sliding_window W  the query at position p sees keys k with p - W < k <= p (W keys, itself
                      included: transformers' sliding_window_overlay, `kv_idx > q_idx - W`).
    softcap C         scores become tanh(s / C) * C before the softmax (Gemma 2). SDPA has no
                      hook for that, so such layers compute their scores explicitly; layers
                      without it keep the fused SDPA call.
The Triton decode kernel takes both as runtime arguments (kernels/paged_attention.py).
Blocks wholly before every window may have been freed (engine/kv/block_manager.py): their table
entries then name the padding block, whose keys the window mask never lets through.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loragw.engine.forward.context import get_forward_context

# Query rows per score matrix in soft-capped layers: [n_heads, 256, L] fp32 at a time.
CAPPED_QUERY_ROWS = 256


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window  # keys (p - W, p] for the query at p; None: all
        self.softcap = softcap  # tanh(s / C) * C on the scores; None: plain softmax
        # Bound by the model runner: [num_blocks, block_size, n_kv_heads, D] each.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, n_heads, D]  k, v: [T, n_kv_heads, D] -> out: [T, n_heads * D]
        ctx = get_forward_context()
        meta = ctx.attn
        if ctx.backends.store_kv is not None:  # the CPU kernel's copy
            ctx.backends.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        else:  # no host sync: a CUDA graph captures it
            self.k_cache.flatten(0, 1).index_copy_(0, meta.slot_mapping, k)
            self.v_cache.flatten(0, 1).index_copy_(0, meta.slot_mapping, v)

        out = torch.empty_like(q)
        decoded = meta.num_decode_tokens
        kernel = ctx.backends.decode_attention  # None: the torch path below
        if decoded and kernel is not None:
            kernel(q[:decoded], self.k_cache, self.v_cache, meta.decode_block_tables,
                   meta.decode_context_lens, self.scale, out=out[:decoded],
                   sliding_window=self.sliding_window, softcap=self.softcap)
        elif decoded and meta.decode_chunks is not None and self.sliding_window is None:
            for chunk in meta.decode_chunks:  # cache-sized gathers, each at its own width
                rows = self._gather_attend(q.index_select(0, chunk.rows), chunk.block_ids,
                                           chunk.mask)
                out.index_copy_(0, chunk.rows, rows)
        elif decoded:
            assert meta.decode_block_ids is not None, "the model runner built no torch decode addressing"
            out[:decoded] = self._decode(q[:decoded], meta.decode_block_ids, meta.decode_mask,
                                         meta.decode_block_tables, meta.decode_context_lens)
        for start, q_len, ctx_len, table in zip(meta.prefill_query_starts, meta.prefill_query_lens,
                                                meta.prefill_context_lens,
                                                meta.prefill_block_tables):
            out[start:start + q_len] = self._prefill(q[start:start + q_len], table, ctx_len)
        return out.view(q.shape[0], -1)

    def _gather(self, cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
        # tables: [..., n_blocks] -> [..., length, n_kv_heads, D]
        gathered = cache[tables]  # [..., n_blocks, block_size, n_kv, D]
        gathered = gathered.flatten(-4, -3)
        return gathered[..., :length, :, :]

    def _prefill(self, q: torch.Tensor, table: torch.Tensor, ctx_len: int) -> torch.Tensor:
        # q: [Q, n_heads, D], context of ctx_len tokens whose last Q are this chunk.
        q_len = q.shape[0]
        start = 0  # the first gathered key: a sliding layer skips blocks before the chunk's window
        if self.sliding_window is not None:
            block_size = self.k_cache.shape[1]
            start = max(0, ctx_len - q_len - self.sliding_window + 1) // block_size * block_size
            table = table[start // block_size:]
        k = self._gather(self.k_cache, table, ctx_len - start).transpose(0, 1)  # [n_kv, L, D]
        v = self._gather(self.v_cache, table, ctx_len - start).transpose(0, 1)
        q = q.transpose(0, 1)  # [n_heads, Q, D]
        if self.softcap is None and self.sliding_window is None and ctx_len == q_len:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1, scale=self.scale,
                                                 enable_gqa=True)
        else:
            # Query i sits at position ctx_len - q_len + i and sees keys up to there.
            rows = torch.arange(q_len, device=q.device)[:, None] + (ctx_len - q_len)
            keys = torch.arange(start, ctx_len, device=q.device)[None, :]
            mask = keys <= rows  # [Q, L]
            if self.sliding_window is not None:
                mask &= keys > rows - self.sliding_window
            out = self._attend(q, k, v, mask)
        return out.transpose(0, 1)  # [Q, n_heads, D]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        # q: [..., n_heads, Q, D]  k, v: [..., n_kv, L, D]  mask: bool, broadcast to [..., n_heads, Q, L]
        if self.softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                                  enable_gqa=True)
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=-3)  # [..., n_heads, L, D]: query head h reads kv h // G
        v = v.repeat_interleave(group, dim=-3)
        # Scores are materialised, so a long prompt goes CAPPED_QUERY_ROWS queries at a time.
        outs = []
        for i in range(0, q.shape[-2], CAPPED_QUERY_ROWS):
            rows = slice(i, i + CAPPED_QUERY_ROWS)
            scores = (q[..., rows, :] @ k.transpose(-1, -2)) * self.scale  # [..., n_heads, q, L]
            scores = torch.tanh(scores / self.softcap) * self.softcap
            scores = scores.masked_fill(~mask[..., rows, :], float("-inf"))
            # softmax in float32, as transformers' eager attention does, then back to q's dtype
            outs.append(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)

    def _decode(self, q: torch.Tensor, block_ids: torch.Tensor, mask: torch.Tensor,
                tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        # q: [B, n_heads, D]  block_ids: [B * W]  mask: [B, 1, 1, W * block_size]
        # tables: [B, W] int32 (block_ids unflattened)  context_lens: [B] int32
        if self.sliding_window is not None:
            block_ids, mask = self._window_blocks(tables, context_lens, block_ids, mask)
        return self._gather_attend(q, block_ids, mask)

    def _gather_attend(self, q: torch.Tensor, block_ids: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        # q: [B, n_heads, D]  block_ids: [B * W]  mask: [B, 1, 1, W * block_size]
        batch, length = q.shape[0], mask.shape[-1]
        # Whole blocks (block_size * n_kv * D contiguous values each): one index per block, not
        # per position, makes the gather ~10% cheaper on CPU.
        k = self.k_cache.flatten(1).index_select(0, block_ids).view(batch, length, self.num_kv_heads, -1)
        v = self.v_cache.flatten(1).index_select(0, block_ids).view(batch, length, self.num_kv_heads, -1)
        out = self._attend(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                           mask)  # [B, n_heads, 1, D]
        return out[:, :, 0, :]

    def _window_blocks(self, tables: torch.Tensor, context_lens: torch.Tensor,
                       block_ids: torch.Tensor, mask: torch.Tensor):
        """The blocks and mask of a sliding layer's decode rows: only the N = cdiv(W, block_size)
        + 1 blocks that can hold a row's window are gathered once the tables are wider than
        that, so the gather stays bounded however long the context. Device ops only: a CUDA
        graph can replay them. Returns (block_ids [B * N'], mask [B, 1, 1, N' * block_size])."""
        # the query sits at context_len - 1 and sees keys [context_len - W, context_len)
        block_size, window = self.k_cache.shape[1], self.sliding_window
        ctx = context_lens.long()[:, None]  # [B, 1]
        width, span = tables.shape[1], -(-window // block_size) + 1
        if span >= width:  # the whole table is no wider than a window: mask what is gathered
            keys = torch.arange(mask.shape[-1], device=mask.device)[None, :]
            return block_ids, mask & (keys >= ctx - window)[:, None, None, :]
        first = (ctx - window).clamp(min=0) // block_size  # [B, 1]: the window's first block
        cols = (first + torch.arange(span, device=tables.device)).clamp(max=width - 1)  # [B, N]
        keys = first * block_size + torch.arange(span * block_size, device=tables.device)
        # columns clamped past a table's end sit at positions >= context_len: masked out
        window_mask = (keys < ctx) & (keys >= ctx - window)  # [B, N * block_size]
        return tables.gather(1, cols).reshape(-1).long(), window_mask[:, None, None, :]
