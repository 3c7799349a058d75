"""Attention over the paged KV cache.

New keys/values are scattered into the cache by slot; queries then read their whole context
back through the sequence's block table. Prefill rows run one SDPA call per sequence, causal
within the chunk and full over the cached prefix. Decode rows (one query each) run on the
backend the engine chose at start-up (ForwardContext.backends.attention, engine/backends.py):

    triton  kernels/paged_attention.py: one flash-decoding kernel reads each K/V block in place
            through the padded block tables (AttentionMetadata.decode_block_tables and
            decode_context_lens). The default on CUDA.
    torch   gather each decode row's whole blocks (decode_block_ids) into a padded
            [B, L, n_kv, D] copy, then one batched SDPA call under decode_mask. The default on
            CPU (the Triton interpreter is far too slow to serve with).
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_context import get_forward_context


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        # Bound by the model runner: [num_blocks, block_size, n_kv_heads, D] each.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, n_heads, D]  k, v: [T, n_kv_heads, D] -> out: [T, n_heads * D]
        ctx = get_forward_context()
        meta = ctx.attn
        num_blocks, block_size = self.k_cache.shape[:2]
        k_flat = self.k_cache.view(num_blocks * block_size, self.num_kv_heads, self.head_dim)
        v_flat = self.v_cache.view(num_blocks * block_size, self.num_kv_heads, self.head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k)  # no host sync: a CUDA graph captures it
        v_flat.index_copy_(0, meta.slot_mapping, v)

        out = torch.empty_like(q)
        decoded = meta.num_decode_tokens
        if decoded and ctx.backends.attention == "triton":
            paged = importlib.import_module("kernels.paged_attention")  # triton only when used
            paged.paged_attention_decode(q[:decoded], self.k_cache, self.v_cache,
                                         meta.decode_block_tables, meta.decode_context_lens,
                                         self.scale, out=out[:decoded])
        elif decoded:
            assert meta.decode_block_ids is not None, "the model runner built no torch decode addressing"
            out[:decoded] = self._decode(q[:decoded], meta.decode_block_ids, meta.decode_mask)
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
        k = self._gather(self.k_cache, table, ctx_len).transpose(0, 1)  # [n_kv, L, D]
        v = self._gather(self.v_cache, table, ctx_len).transpose(0, 1)
        q = q.transpose(0, 1)  # [n_heads, Q, D]
        if ctx_len == q_len:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1, scale=self.scale,
                                                 enable_gqa=True)
        else:
            # Query i sits at position ctx_len - q_len + i and sees keys up to there.
            rows = torch.arange(q_len, device=q.device)[:, None] + (ctx_len - q_len)
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= rows  # [Q, L]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=True)
        return out.transpose(0, 1)  # [Q, n_heads, D]

    def _decode(self, q: torch.Tensor, block_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # q: [B, n_heads, D]  block_ids: [B * max_blocks]  mask: [B, 1, 1, L]
        batch, length = q.shape[0], mask.shape[-1]
        # Whole blocks (block_size * n_kv * D contiguous values each): one index per block, not
        # per position, makes the gather ~10% cheaper on CPU.
        k = self.k_cache.flatten(1).index_select(0, block_ids).view(batch, length, self.num_kv_heads, -1)
        v = self.v_cache.flatten(1).index_select(0, block_ids).view(batch, length, self.num_kv_heads, -1)
        out = F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=self.scale,
                                             enable_gqa=True)  # [B, n_heads, 1, D]
        return out[:, :, 0, :]
