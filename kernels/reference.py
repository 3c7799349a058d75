"""Plain-PyTorch LoRA kernels: the meaning of each Triton kernel, and the CPU production path.

`lora_shrink` / `lora_expand`, per-slot form: for each slot that has tokens, gather its tokens
(index_select), multiply by the rank-r slice of its weights (a rank-8 adapter in a rank-64
pool does rank-8 work), and scatter back.

`apply_lora`, the CPU production path: the same per-slot loop for slots with many tokens
(prefill chunks, popular adapters; a chunk's contiguous rows are sliced, not gathered), and
one gather-bmm over the tokens of all the other slots (decode steps with many distinct
adapters), so a step's op count does not grow with its number of adapters. Which slot goes
which way is decided once per step (kernels/cpu_dispatch.py).

Math runs in float32 whatever the input dtype (bf16 matmuls on CPU are ~100x slower than
fp32, and the kernels accumulate in fp32 too).

`oracle_shrink` / `oracle_apply` / `oracle_embedding_lora` are the float64 per-token loops the
tests compare against;
`oracle_paged_attention` is the meaning of kernels/paged_attention.py (decode attention read
through block tables), gathered per sequence and computed in float64.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import Tensor

from loragw.kernels import cpu_lora, native
from loragw.kernels.cpu_dispatch import (
    BagTables,
    GatherGroup,
    Rows,
    bag_tables,
    step_plan,
    workspace,
)
from loragw.kernels.meta import LoRAMeta


def lora_shrink(x: Tensor, lora_a: Tensor, ranks: Tensor, meta: LoRAMeta, y: Tensor) -> None:
    """y[i, t, :r] = x[t] @ lora_a[i, slot(t), :r].T   (r = ranks[i, slot(t)]; y is written only there)

    x: [T, H] (fp32/fp16/bf16)   lora_a: [n, S, R, H] (x.dtype)   ranks: [n, S] int32
    y: [n, T, R] float32, zero where not written
    """
    ranks_cpu = ranks.tolist()                                    # [n][S]
    for slot, start, count in meta.segments:
        ids = meta.sorted_token_ids[start:start + count].long()  # [c]
        xs = x.index_select(0, ids).float()                       # [c, H]
        for i, slice_ranks in enumerate(ranks_cpu):
            r = slice_ranks[slot]
            if r:
                y[i, ids, :r] = xs @ lora_a[i, slot, :r].float().T  # [c, r]


def lora_expand(out: Tensor, y: Tensor, lora_b: Tensor, ranks: Tensor, scales: Tensor,
                slice_offsets: tuple[int, ...], meta: LoRAMeta) -> None:
    """out[t, o[i]:o[i+1]] += scales[i, slot(t)] * y[i, t, :r] @ lora_b[slot(t), o[i]:o[i+1], :r].T

    out: [T, O] (x.dtype)   y: [n, T, R] float32   lora_b: [S, O, R] (x.dtype)
    ranks: [n, S] int32   scales: [n, S] float32   slice_offsets: n+1 ints, 0 .. O
    """
    ranks_cpu, scales_cpu = ranks.tolist(), scales.tolist()       # [n][S]
    for slot, start, count in meta.segments:
        ids = meta.sorted_token_ids[start:start + count].long()  # [c]
        for i, (lo, hi) in enumerate(pairwise(slice_offsets)):
            r = ranks_cpu[i][slot]
            if r:
                ys = y[i].index_select(0, ids)[:, :r]             # [c, r] fp32
                delta = scales_cpu[i][slot] * (ys @ lora_b[slot, lo:hi, :r].float().T)  # [c, hi-lo]
                out[:, lo:hi].index_add_(0, ids, delta.to(out.dtype))


def apply_lora(out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, ranks: Tensor,
               scales: Tensor, slice_offsets: tuple[int, ...], meta: LoRAMeta) -> None:
    """lora_shrink then lora_expand, without the [n, T, R] intermediate: the CPU production path.

    out: [T, O]   x: [T, H]   lora_a: [n, S, R, H]   lora_b: [S, O, R]   ranks, scales: [n, S]
    Slots with many tokens run the per-slot loop; the slots with few tokens, together, one
    gather-bmm over their tokens (kernels/cpu_dispatch.py says which, once per step).
    """
    plan = step_plan(meta)
    ranks_cpu, scales_cpu = ranks.tolist(), scales.tolist()       # [n][S]
    offsets = tuple(pairwise(slice_offsets))
    for item in plan.loop:
        _apply_slot(out, x, lora_a, lora_b, ranks_cpu, scales_cpu, offsets, item.slot, item.rows)
    if plan.gather is not None:
        tables = bag_tables(lora_a, lora_b, ranks, scales, slice_offsets)
        if tables is not None:
            _apply_bagged(out, x, tables, ranks_cpu, offsets, plan.gather)
        else:
            _apply_gathered(out, x, lora_a, lora_b, ranks, scales, ranks_cpu, offsets, plan.gather)


def _apply_slot(out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, ranks_cpu, scales_cpu,
                offsets, slot: int, rows: Rows) -> None:
    """One slot's tokens (rows: a contiguous range or an index) times that slot's weights."""
    contiguous = isinstance(rows, slice)
    xs = (x[rows] if contiguous else x.index_select(0, rows)).float()  # [c, H]
    for i, (lo, hi) in enumerate(offsets):
        r = ranks_cpu[i][slot]
        if not r:
            continue
        ys = (xs @ lora_a[i, slot, :r].float().T) * scales_cpu[i][slot]  # [c, r] fp32
        delta = (ys @ lora_b[slot, lo:hi, :r].float().T).to(out.dtype)   # [c, hi-lo]
        if contiguous:
            out[rows, lo:hi] += delta
        else:
            out[:, lo:hi].index_add_(0, rows, delta)


def _apply_bagged(out: Tensor, x: Tensor, tables: BagTables, ranks_cpu, offsets,
                  group: GatherGroup) -> None:
    """Each token of the group times its own slot's weights as embedding bags: one bag over H
    rows of the A table (every slice at once), then per slice one bag over R_i rows of its B
    table. No weight is copied, and the op count does not depend on the number of slots."""
    rows = group.rows
    active = [i for i in range(len(offsets))
              if tables.b[i] is not None and any(ranks_cpu[i][s] for s in group.slot_list)]
    if not active:
        return  # no slot of the group adapts this projection (e.g. o_proj of a q,v adapter)
    if cpu_lora.usable(out, x):  # the same sums, in C, one call (kernels/cpu_lora.py)
        cpu_lora.apply_bags(out, x, tables, active, offsets, group)
        return
    xs = (x if isinstance(rows, slice) else x.index_select(0, rows)).float()     # [L, H]
    H = xs.shape[1]
    y = F.embedding_bag(group.bag_index(H), tables.a, per_sample_weights=xs.contiguous(),
                        mode="sum")                                              # [L, sum R_i]
    for i in active:
        (lo, hi), c0, c1 = offsets[i], tables.cols[i], tables.cols[i + 1]
        delta = F.embedding_bag(group.bag_index(c1 - c0), tables.b[i],
                                per_sample_weights=y[:, c0:c1].contiguous(), mode="sum")
        delta = delta.to(out.dtype)                                              # [L, hi-lo]
        if isinstance(rows, slice):
            out[:, lo:hi] += delta
        else:
            out[:, lo:hi].index_add_(0, rows, delta)


def _apply_gathered(out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, ranks: Tensor,
                    scales: Tensor, ranks_cpu, offsets, group: GatherGroup) -> None:
    """Each token of the group times its own slot's weights, gathered up to the group's largest
    rank per slice: a constant number of ops however many slots the group holds.

    The gathered weights land in a reused workspace: fresh multi-MB temporaries every call
    would be returned to the OS and page-faulted back in (that cost more than the math).
    Rank padding is never trusted to be zero: when the group mixes ranks, y columns past a
    token's rank are selected away (not multiplied by 0: padding may hold NaN) and so are the
    matching B columns."""
    rows, slots, L = group.rows, group.slots, group.num_tokens
    xs = None
    for i, (lo, hi) in enumerate(offsets):
        slot_ranks = [ranks_cpu[i][s] for s in group.slot_list]
        r = max(slot_ranks)
        if not r:
            continue  # no slot of the group adapts this slice (e.g. k_proj of a q,v adapter)
        if xs is None:
            xs = (x if isinstance(rows, slice) else x.index_select(0, rows)).float()  # [L, H]
        H, width = xs.shape[1], hi - lo
        space = workspace(L * r * max(H, width), lora_a.dtype, x.device)
        a = torch.index_select(lora_a[i, :, :r], 0, slots, out=space[:L * r * H].view(L, r, H))
        ys = torch.bmm(xs.unsqueeze(1), a.float().transpose(1, 2))        # [L, 1, r] fp32
        ys *= scales[i].index_select(0, slots).view(L, 1, 1)
        b = torch.index_select(lora_b[:, lo:hi, :r], 0, slots,
                               out=space[:L * width * r].view(L, width, r)).float()  # [L, width, r]
        if min(slot_ranks) != r:                                          # mixed ranks
            keep = (torch.arange(r, device=xs.device)
                    < ranks[i].index_select(0, slots).view(L, 1, 1))      # [L, 1, r]
            ys = torch.where(keep, ys, 0.0)
            b = b.masked_fill_(~keep, 0.0)
        delta = torch.bmm(ys, b.transpose(1, 2)).view(L, width).to(out.dtype)  # [L, width]
        if isinstance(rows, slice):
            out[:, lo:hi] += delta
        else:
            out[:, lo:hi].index_add_(0, rows, delta)


def oracle_shrink(x: Tensor, lora_a: Tensor, ranks: Tensor, token_slots: Tensor) -> Tensor:
    """float64 per-token loop of lora_shrink, on the CPU. Returns y: [n, T, R] float64."""
    n, _, R, _ = lora_a.shape
    x, lora_a, ranks_cpu = x.cpu().double(), lora_a.cpu(), ranks.tolist()
    y = torch.zeros(n, x.shape[0], R, dtype=torch.float64)
    for t, slot in enumerate(token_slots.tolist()):
        for i in range(n):
            r = ranks_cpu[i][slot] if slot >= 0 else 0
            if r:
                y[i, t, :r] = lora_a[i, slot, :r].double() @ x[t]
    return y


def oracle_expand(out: Tensor, y: Tensor, lora_b: Tensor, ranks: Tensor, scales: Tensor,
                  slice_offsets: tuple[int, ...], token_slots: Tensor) -> Tensor:
    """float64 per-token loop of lora_expand, on the CPU. Returns the expected out: [T, O] float64."""
    expected = out.to("cpu", torch.float64, copy=True)            # [T, O]
    y, lora_b, ranks_cpu, scales_cpu = y.cpu().double(), lora_b.cpu(), ranks.tolist(), scales.tolist()
    for t, slot in enumerate(token_slots.tolist()):
        for i, (lo, hi) in enumerate(pairwise(slice_offsets)):
            r = ranks_cpu[i][slot] if slot >= 0 else 0
            if r:
                b = lora_b[slot, lo:hi, :r].double()              # [hi-lo, r]
                expected[t, lo:hi] += scales_cpu[i][slot] * (b @ y[i, t, :r])
    return expected


def oracle_apply(out: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, ranks: Tensor,
                 scales: Tensor, slice_offsets: tuple[int, ...], token_slots: Tensor) -> Tensor:
    """float64 shrink then expand, per token. Returns the expected out: [T, O] float64."""
    y = oracle_shrink(x, lora_a, ranks, token_slots)
    return oracle_expand(out, y, lora_b, ranks, scales, slice_offsets, token_slots)


def oracle_embedding_lora(out: Tensor, ids: Tensor, lora_a: Tensor, lora_b: Tensor,
                          ranks: Tensor, scales: Tensor, token_slots: Tensor) -> Tensor:
    """float64 per-token loop of ops.embedding_lora. Returns the expected out: [T, H] float64."""
    expected = out.to("cpu", torch.float64, copy=True)            # [T, H]
    ranks_cpu, scales_cpu = ranks.tolist(), scales.tolist()       # [1][S]
    for t, (slot, token) in enumerate(zip(token_slots.tolist(), ids.tolist(), strict=True)):
        r = ranks_cpu[0][slot] if slot >= 0 else 0
        if r:
            a = lora_a[slot, token, :r].cpu().double()            # [r]
            expected[t] += scales_cpu[0][slot] * (lora_b[slot, :, :r].cpu().double() @ a)
    return expected


def oracle_paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                           context_lens: Tensor, scale: float, sliding_window: int | None = None,
                           softcap: float | None = None) -> Tensor:
    """out[b, h] = softmax(cap(scale * q[b, h] @ K[b, :, h // G].T)) @ V[b, :, h // G] in
    float64, K[b, t] = k_cache[block_tables[b, t // block_size], t % block_size] for t <
    context_lens[b] (and t >= context_lens[b] - sliding_window); cap(s) = softcap * tanh(s /
    softcap), the identity when softcap is None.

    q: [B, n_heads, D]   k_cache, v_cache: [N, block_size, n_kv, D]   block_tables: [B, W]
    context_lens: [B]. Returns out: [B, n_heads, D] float64 on q's device (zeros where the
    context is empty). Only the table's blocks, up to the context length, are read; of them,
    only the window's keys are used.
    """
    B, n_heads, D = q.shape
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv
    out = torch.zeros(B, n_heads, D, dtype=torch.float64, device=q.device)
    for b, length in enumerate(context_lens.tolist()):
        if not length:
            continue
        blocks = block_tables[b, :-(-length // block_size)].long()           # [nb]
        k = k_cache[blocks].flatten(0, 1)[:length].double()                  # [L, n_kv, D]
        v = v_cache[blocks].flatten(0, 1)[:length].double()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)                # [n_heads, L, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        first = max(0, length - sliding_window) if sliding_window is not None else 0
        k, v = k[:, first:], v[:, first:]                                    # the window's keys
        scores = scale * (k @ q[b].double().unsqueeze(2)).squeeze(2)         # [n_heads, L]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        out[b] = (scores.softmax(dim=-1).unsqueeze(1) @ v).squeeze(1)        # [n_heads, D]
    return out


def paged_decode_problem(decode, device: torch.device, dtype: torch.dtype, num_heads: int,
                         num_kv_heads: int, head_dim: int, sliding_window: int | None,
                         softcap: float | None, tolerance: float) -> str | None:
    """Why the paged decode kernel `decode` (kernels/paged_attention.py's signature) must not
    serve these shapes on `device`, or None when it may: one small random paged cache (ragged
    contexts across block boundaries, shuffled blocks) run through it and compared with
    oracle_paged_attention, plainly and, when given, with a window (at most 24 keys, so that it
    cuts the contexts) and the cap. A kernel that fails to build or launch says why."""
    cases = [(None, None)]
    if sliding_window is not None or softcap is not None:
        cases.append((min(sliding_window, 24) if sliding_window is not None else None, softcap))
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        lens = [1, 17, 40]
        tables = torch.randperm(12, generator=g)[:9].view(3, 3).to(torch.int32)  # [B, 3]
        rand = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
        q = rand(3, num_heads, head_dim)
        k_cache, v_cache = (rand(12, 16, num_kv_heads, head_dim) for _ in range(2))
        tables = tables.to(device)
        context = torch.tensor(lens, dtype=torch.int32, device=device)
        scale = head_dim ** -0.5
        errors = []
        for window, cap in cases:
            out = decode(q, k_cache, v_cache, tables, context, scale, sliding_window=window,
                         softcap=cap)
            want = oracle_paged_attention(q, k_cache, v_cache, tables, context, scale, window, cap)
            errors.append((out.double() - want).abs().max().item())
    except Exception as exc:  # a build, compile or launch failure here
        return native.exception_problem(exc)
    for error in errors:
        if not error <= tolerance:  # also catches NaN
            return f"max error {error:.3g} vs the float64 reference exceeds {tolerance:g}"
    return None

