"""How the CPU production path (kernels/reference.py `apply_lora`) splits one step's tokens,
and the per-step and per-pool data it precomputes for that.

Two ways to add the LoRA delta on a CPU, each fast for one traffic shape:

- per-slot loop: for each slot, take its tokens and multiply by that slot's weights. A slot's
  weights are read once, by a real GEMM, but each slot costs ~5 small ops per output slice:
  with 32 distinct adapters in a decode step that is ~160 op dispatches per projection.
- embedding bags over tokens: the pool laid out once as bag tables (`BagTables`: A as
  [S*H, R] rows, B as [S*R, O] rows, scales folded in), then one `F.embedding_bag` per token
  group reads each token's own rows: a constant number of ops however many adapters share the
  step, and no weight copy. (The fallback, for pools without a version counter: gather-bmm,
  which copies each token's A and B rows, then one bmm.)

So a prefill chunk (a long contiguous run of one slot's tokens) runs the loop, and every other
slot goes into one bag group, a lone slot too. `use_per_slot_loop` is that rule. Measured per layer of the 25M Llama in benchmarks/bench_lora_cpu.py (all seven targets,
rank 16, one thread; loop us / bags us), k slots of c tokens each:
    decode rows (interleaved):   k=32 c=1 3787/437   k=2 c=1 250/156   k=2 c=128 2436/1777
    one slot:                    k=1 c=1 128/145     k=1 c=128 640/886
    prefill chunks (contiguous): k=2 c=16 366/328    k=4 c=32 979/893  k=4 c=64 1503/1621
                                 k=8 c=64 3064/3157  k=2 c=128 1248/1605

The plan depends only on the step's LoRAMeta, so it is built once per step and reused by every
projection: `step_plan(meta)` caches it on the meta object it was given.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from itertools import pairwise

import torch
from torch import Tensor

from loragw.kernels.meta import LoRAMeta

# A slot whose tokens in the step are one contiguous run of at least this many (a prefill
# chunk) runs the per-slot loop: one GEMM per slice beats a bag per token from about here.
LOOP_MIN_RUN = 48
# A bag group of fewer slots than this runs the per-slot loop instead. One: since the bags run
# in C (kernels/cpu_lora.py) a lone slot's few tokens are cheaper as a bag too (q/k/v, gate/up
# and down of the bench Llama, one slot, 2 threads, us per layer, loop / bags: 1 token 223 / 112,
# 5 tokens 239 / 144, 16 tokens 542 / 336, 47 tokens 638 / 600; 1 thread, 1 token 415 / 193).
GATHER_MIN_SLOTS = 1


def use_per_slot_loop(num_tokens: int, contiguous: bool, num_small_slots: int) -> bool:
    """Whether a slot with `num_tokens` tokens this step (one contiguous run or not) runs the
    per-slot loop, given that `num_small_slots` slots of the step are not long runs."""
    long_run = contiguous and num_tokens >= LOOP_MIN_RUN
    return long_run or num_small_slots < GATHER_MIN_SLOTS


Rows = slice | Tensor  # a contiguous range of token rows, or an int64 index of them


@dataclass(slots=True)
class LoopSlot:
    slot: int
    rows: Rows        # the slot's tokens: slice when they are contiguous (prefill), else [c] int64


@dataclass(slots=True)
class GatherGroup:
    rows: Rows        # the group's tokens: slice(None) when it is every token, else [L] int64
    slots: Tensor     # [L] int64: slot of each of those tokens
    slot_list: tuple[int, ...]  # the distinct slots of the group (their ranks bound the work)
    num_tokens: int   # L
    bag_indices: dict[int, Tensor] = field(default_factory=dict)  # filled by bag_index

    def bag_index(self, width: int) -> Tensor:
        """[L, width] int64: row slot(t) * width + k of a [S * width, ...] bag table, k < width
        (built once per step and width, shared by every projection)."""
        index = self.bag_indices.get(width)
        if index is None:
            k = torch.arange(width, device=self.slots.device)
            index = self.bag_indices[width] = self.slots.view(-1, 1) * width + k
        return index


@dataclass(slots=True)
class StepPlan:
    loop: tuple[LoopSlot, ...]
    gather: GatherGroup | None


def make_step_plan(meta: LoRAMeta) -> StepPlan:
    """Split the step's slots into looped ones and one bag group (see use_per_slot_loop)."""
    device = meta.sorted_token_ids.device
    sorted_ids = meta.sorted_token_ids.tolist()                   # [T]
    segments = [(slot, sorted_ids[start:start + count]) for slot, start, count in meta.segments]
    # ids ascend within a slot (stable sort): a run when last - first == count - 1
    runs = [ids[-1] - ids[0] == len(ids) - 1 for _, ids in segments]
    num_small = sum(1 for (_, ids), run in zip(segments, runs, strict=True)
                    if not (run and len(ids) >= LOOP_MIN_RUN))
    loop, gathered = [], []
    for (slot, ids), run in zip(segments, runs, strict=True):
        if use_per_slot_loop(len(ids), run, num_small):
            rows = (slice(ids[0], ids[-1] + 1) if run
                    else torch.tensor(ids, dtype=torch.int64, device=device))
            loop.append(LoopSlot(slot, rows))
        else:
            gathered.append((slot, ids))
    group = None
    if gathered:
        num_tokens = sum(len(ids) for _, ids in gathered)
        if num_tokens == meta.num_tokens:  # every token: no gather of x, no scatter of out
            rows, slots = slice(None), meta.token_slots.to(torch.int64)
        else:
            rows = torch.tensor([t for _, ids in gathered for t in ids], dtype=torch.int64,
                                device=device)
            slots = meta.token_slots.index_select(0, rows).to(torch.int64)
        group = GatherGroup(rows, slots, tuple(slot for slot, _ in gathered), num_tokens)
    return StepPlan(tuple(loop), group)


_cache: tuple[LoRAMeta, tuple, int, StepPlan] | None = None


def step_plan(meta: LoRAMeta) -> StepPlan:
    """make_step_plan(meta), built once per meta (every projection of a step shares it).

    Keyed on the meta object, its segments and the version counter of its token index, so
    a meta refilled in place (`LoRAMeta.copy_` replaces `segments`) gets a new plan."""
    global _cache
    ids = meta.sorted_token_ids
    version = -1 if ids.is_inference() else ids._version  # inference tensors keep no version
    entry = _cache
    if entry is not None and entry[0] is meta and entry[1] is meta.segments and entry[2] == version:
        return entry[3]
    plan = make_step_plan(meta)
    _cache = (meta, meta.segments, version, plan)
    return plan


class _Workspace(threading.local):
    buffers: dict[tuple[torch.dtype, torch.device], Tensor]

    def __init__(self) -> None:
        self.buffers = {}


_workspace = _Workspace()


def workspace(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A flat scratch buffer of at least `numel` elements, reused across calls (per thread,
    dtype and device; it grows, never shrinks). Its contents are garbage."""
    key = (dtype, device)
    buffer = _workspace.buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor works in and out of inference mode
            buffer = torch.empty(numel, dtype=dtype, device=device)
        _workspace.buffers[key] = buffer
    return buffer


@dataclass(slots=True)
class BagTables:
    """A projection's slot pool laid out for F.embedding_bag (float32): rank padding zeroed,
    scales folded into B, so one bag per token reads exactly its own slot's rows.

    R_i = the largest rank any slot has for slice i (0: no slot adapts it).
    a: [S * H, sum R_i]: row s * H + h = lora_a[i, s, :R_i, h] for every slice i, side by side
    b: per slice, [S * R_i, width_i]: row s * R_i + r = scales[i, s] * lora_b[s, o_i + :, r]
    """

    a: Tensor
    b: tuple[Tensor | None, ...]
    cols: tuple[int, ...]     # n+1: slice i's ranks are columns cols[i]:cols[i+1] of a
    key: tuple                # versions of the pool tensors it was built from, and the offsets
    # the C kernel's array arguments, built once per set of active slices (kernels/cpu_lora.py)
    native: dict = field(default_factory=dict)


def _build_tables(lora_a: Tensor, lora_b: Tensor, ranks: Tensor, scales: Tensor,
                  slice_offsets: tuple[int, ...], key: tuple) -> BagTables:
    n, S, _, H = lora_a.shape
    widths = ranks.amax(dim=1).tolist()                           # [n] R_i
    a_parts, b_parts = [], []
    for i, (lo, hi) in enumerate(pairwise(slice_offsets)):
        r = widths[i]
        if not r:
            b_parts.append(None)
            continue
        keep = torch.arange(r, device=ranks.device) < ranks[i].view(S, 1)   # [S, r]
        a = torch.where(keep.unsqueeze(2), lora_a[i, :, :r].float(), 0.0)   # [S, r, H]
        a_parts.append(a.transpose(1, 2))                                    # [S, H, r]
        b = torch.where(keep.unsqueeze(1), lora_b[:, lo:hi, :r].float(), 0.0)  # [S, width, r]
        b = b * scales[i].view(S, 1, 1)
        b_parts.append(b.transpose(1, 2).reshape(S * r, hi - lo).contiguous())  # [S * r, width]
    cols = [0]
    for r in widths:
        cols.append(cols[-1] + r)
    a = (torch.cat(a_parts, dim=2).reshape(S * H, cols[-1]) if a_parts
         else lora_a.new_zeros(S * H, 0, dtype=torch.float32))
    return BagTables(a, tuple(b_parts), tuple(cols), key)


# After a slot fill, rebuild a pool's tables only once it has stayed unchanged for this many
# calls (steps); until then that pool takes the gather-bmm. A rebuild of every projection costs
# ~28 ms with 32 slots of all-seven rank-16 adapters on the 25M Llama, the bags save ~4 ms per
# decode step there: under slot churn (a fill every step or two) rebuilding would cost more
# than it saves.
TABLES_STABLE_CALLS = 8


@dataclass(slots=True)
class _TablesEntry:
    pool: weakref.ref         # lora_a, to tell a reused id() apart
    tables: BagTables | None  # None until first built
    pending: tuple | None = None  # a newer key, and for how many calls it has held
    pending_calls: int = 0


_tables: dict[int, _TablesEntry] = {}


def bag_tables(lora_a: Tensor, lora_b: Tensor, ranks: Tensor, scales: Tensor,
               slice_offsets: tuple[int, ...]) -> BagTables | None:
    """The pool's BagTables, or None: use the gather-bmm this time.

    Built on first sight of a pool; after its tensors are written again (their version
    counters: slot fills write them in place), rebuilt once they have stayed unchanged for
    TABLES_STABLE_CALLS calls, None meanwhile. None always when a pool tensor is an inference
    tensor (no version counter, so no safe cache). The tables are a float32 copy of the pool."""
    pool = (lora_a, lora_b, ranks, scales)
    if any(t.is_inference() for t in pool):
        return None
    key = (*(t._version for t in pool), tuple(slice_offsets))
    entry = _tables.get(id(lora_a))
    if entry is None or entry.pool() is not lora_a:
        entry = _tables[id(lora_a)] = _TablesEntry(weakref.ref(lora_a), None, key, TABLES_STABLE_CALLS)
        weakref.finalize(lora_a, _tables.pop, id(lora_a), None)
    elif entry.tables is not None and entry.tables.key == key:
        return entry.tables
    elif entry.pending != key:
        entry.pending, entry.pending_calls = key, 1
        return None
    else:
        entry.pending_calls += 1
        if entry.pending_calls < TABLES_STABLE_CALLS:
            return None
    with torch.inference_mode(False):
        entry.tables = _build_tables(lora_a, lora_b, ranks, scales, tuple(slice_offsets), key)
    entry.pending, entry.pending_calls = None, 0
    return entry.tables
