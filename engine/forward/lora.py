"""Which adapter slot every row of one step uses: what the slot pool decides (`LoRARows`, plain
data, which a tensor-parallel step carries to every rank as it is) and what the layers read
(`LoRAStep`: the kernels' metas on the step's device), made from it in one place,
`LoRAStep.build`, by the model runner, which alone knows the device and how many rows the
step is padded to. Both exist only for steps in which some row has an adapter.

    tokens   every new token's slot (the projections, embed_tokens, the experts), padded
    sample   every logit row's slot (lm_head), when some such slot has an lm_head LoRA
    full     the rows whose adapter replaces embed_tokens or lm_head with its own saved copy
             (PEFT's modules_to_save), grouped by adapter, when some row's adapter has one
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loragw.adapters.types import EMBED_TOKENS, LM_HEAD
from loragw.kernels import LoRAMeta, make_lora_meta
from loragw.kernels.meta import host_to_device


@dataclass(frozen=True, slots=True)
class LoRARows:
    token_slots: list[int]  # every new token's slot, in the model runner's row order; -1: none
    sample_slots: list[int]  # every logit row's slot (ScheduledBatch.logit_rows), in order
    num_slots: int
    embed: bool  # some token's slot has an embed_tokens LoRA (else that module skips LoRA)
    head: bool  # some logit row's slot has an lm_head LoRA
    experts: bool  # some row's slot holds an expert LoRA (else the experts skip it)
    # the saved copies (target -> [V, H]) of the slots this step uses that have them; None when
    # none does (saved modules are refused under tensor parallelism, so this never crosses)
    full: dict[int, dict[str, torch.Tensor]] | None = None


@dataclass(slots=True)
class FullModuleStep:
    """Rows whose adapter replaces embed_tokens or lm_head with its own saved copy, one group
    per such adapter in the step; every other row keeps the base module."""

    embed: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (weight [V, H], token rows [n] int64)
    head: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (weight [V, H], sampling rows [n] int64)
    head_base_rows: torch.Tensor | None  # [B'] int64: sampling rows on the base lm_head
    # (None when no group replaces lm_head)


@dataclass(slots=True)
class LoRAStep:
    rows: LoRARows
    tokens: LoRAMeta  # over the step's token rows, padding included
    sample: LoRAMeta | None = None  # over its logit rows; None when no lm_head LoRA is used
    full: FullModuleStep | None = None

    @property
    def embed(self) -> bool:
        return self.rows.embed

    @property
    def experts(self) -> bool:
        return self.rows.experts

    @classmethod
    def build(cls, rows: LoRARows, device: torch.device, pad_to: int | None = None,
              out: LoRAMeta | None = None) -> LoRAStep:
        """The metas of one step on `device`, its token rows padded (slot -1) to `pad_to`;
        `out`: a preallocated token meta to refill in place (a decode graph's)."""
        slots = rows.token_slots
        if pad_to is not None:
            slots = slots + [-1] * (pad_to - len(slots))
        tokens = make_lora_meta(slots, rows.num_slots, device=device, out=out)
        sample = (make_lora_meta(rows.sample_slots, rows.num_slots, device=device)
                  if rows.head else None)
        full = _full_step(rows, device) if rows.full else None
        return cls(rows, tokens, sample, full)


def _full_step(rows: LoRARows, device: torch.device) -> FullModuleStep | None:
    held = rows.full

    def groups(slots: list[int], target: str):
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(slots):
            if target in held.get(slot, ()):
                by_slot.setdefault(slot, []).append(row)
        return tuple((held[slot][target], _index(r, device)) for slot, r in by_slot.items())

    embed, head = groups(rows.token_slots, EMBED_TOKENS), groups(rows.sample_slots, LM_HEAD)
    if not embed and not head:
        return None
    base = _index([row for row, slot in enumerate(rows.sample_slots)
                   if LM_HEAD not in held.get(slot, ())], device) if head else None
    return FullModuleStep(embed=embed, head=head, head_base_rows=base)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return host_to_device(rows, device)  # [n]


def embed_full_rows(y: torch.Tensor, ids: torch.Tensor, step: FullModuleStep) -> None:
    """y[t] = E_a[ids[t]] for each (E_a, rows) group and t in rows; in place.
    y: [T, H]   ids: [T]   E_a: [V, H] (y.dtype)"""
    for weight, rows in step.embed:
        y.index_copy_(0, rows, weight.index_select(0, ids.index_select(0, rows)))


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, step: FullModuleStep) -> torch.Tensor:
    """logits[b] = hidden[b] @ W_a.T for the rows of each (W_a, rows) group, hidden[b] @
    weight.T (the base lm_head) for the rest. hidden: [B, H]   weight, W_a: [V, H] -> [B, V]"""
    logits = hidden.new_empty(hidden.shape[0], weight.shape[0])
    groups = ((weight, step.head_base_rows),) + step.head
    for w, rows in groups:
        if rows.numel():
            logits.index_copy_(0, rows, F.linear(hidden.index_select(0, rows), w))
    return logits
