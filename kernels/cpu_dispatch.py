"""How the CPU production path (kernels/reference.py `apply_lora`) splits one step's tokens.

Two ways to add the LoRA delta on a CPU, each fast for one traffic shape:

- per-slot loop: for each slot, take its tokens and multiply by that slot's weights. The
  weights are read once per slot, but each slot costs ~5 small ops per output slice: with 32
  distinct adapters in a decode step that is ~160 op dispatches per projection, which cost
  more than the math.
- gather-bmm: copy each token's own A and B rows (only up to the step's largest rank) and run
  one batched matmul over tokens: a constant number of ops however many adapters share the
  step, but a slot's weights are copied once per *token* that uses it.

So a slot with many tokens (prefill, a popular adapter) runs the loop, and the slots with few
tokens go through one gather-bmm together, when there are enough of them to pay for it.
`use_per_slot_loop` is that rule; the thresholds were measured on the 25M-parameter Llama of
benchmarks/bench_lora_cpu.py (hidden 512/1376, rank 16, 2 cores).

The plan depends only on the step's LoRAMeta, so it is built once per step and reused by every
projection: `step_plan(meta)` caches it on the meta object it was given.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.meta import LoRAMeta

# A slot with at least this many tokens in the step runs the per-slot loop (its weights are
# read once instead of copied per token). Measured per layer, all seven targets, rank 16, k
# slots of c tokens each (loop us / gather-bmm us): c=4: k=2 399/343, k=8 1439/1289;
# c=6: k=2 338/431, k=8 1759/1756; c=1: k=32 5116/1228.
LOOP_MIN_TOKENS = 5
# Fewer small slots than this run the per-slot loop too: one slot costs the loop 122 us and
# a gather-bmm 188 us; two slots of one token cost 244 vs 212.
GATHER_MIN_SLOTS = 2


def use_per_slot_loop(num_tokens: int, num_small_slots: int) -> bool:
    """Whether a slot with `num_tokens` tokens in this step runs the per-slot loop, given that
    `num_small_slots` slots of the step have fewer than LOOP_MIN_TOKENS tokens."""
    return num_tokens >= LOOP_MIN_TOKENS or num_small_slots < GATHER_MIN_SLOTS


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


@dataclass(slots=True)
class StepPlan:
    loop: tuple[LoopSlot, ...]
    gather: GatherGroup | None


def _rows(ids: list[int], device: torch.device) -> Rows:
    if ids[-1] - ids[0] == len(ids) - 1:  # ids ascend within a slot (stable sort)
        return slice(ids[0], ids[-1] + 1)
    return torch.tensor(ids, dtype=torch.int64, device=device)


def make_step_plan(meta: LoRAMeta) -> StepPlan:
    """Split the step's slots into looped ones and one gathered group (see use_per_slot_loop)."""
    device = meta.sorted_token_ids.device
    sorted_ids = meta.sorted_token_ids.tolist()                   # [T]
    num_small = sum(1 for _, _, count in meta.segments if count < LOOP_MIN_TOKENS)
    loop, gathered = [], []
    for slot, start, count in meta.segments:
        if use_per_slot_loop(count, num_small):
            loop.append(LoopSlot(slot, _rows(sorted_ids[start:start + count], device)))
        else:
            gathered.append((slot, start, count))
    group = None
    if gathered:
        num_tokens = sum(count for _, _, count in gathered)
        if num_tokens == meta.num_tokens:  # every token: no gather of x, no scatter of out
            rows, slots = slice(None), meta.token_slots.to(torch.int64)
        else:
            ids = [t for _, start, count in gathered for t in sorted_ids[start:start + count]]
            rows = torch.tensor(ids, dtype=torch.int64, device=device)
            slots = meta.token_slots.index_select(0, rows).to(torch.int64)
        group = GatherGroup(rows, slots, tuple(slot for slot, _, _ in gathered), num_tokens)
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
