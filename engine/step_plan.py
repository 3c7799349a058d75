"""One step as every rank runs it: what the model runner reads of each scheduled sequence, and
the step's adapter slots. `plan_step(batch, lora)` builds it on rank 0 from the scheduler's
batch; `ModelRunner.prepare` reads it; a tensor-parallel step broadcasts it to the worker ranks
as it is (engine/parallel/runner.py), so every rank prepares the same inputs from the same
typed message.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.lora_step import LoRARows
from engine.scheduler import LogitRows, ScheduledBatch
from engine.sequence import Sequence


@dataclass(slots=True)  # not frozen: one per row per step, and a frozen one costs 3x to make
class RowPlan:
    start: int  # the sequence's computed tokens: the position of its first new token
    new_tokens: list[int]  # the tokens it computes this step (one for a decode row; a
    # row verifying drafts: its last token, then the drafts)
    block_table: list[int]  # its KV blocks (the sequence's own list: read within the step)


@dataclass(frozen=True, slots=True)
class StepPlan:
    rows: list[RowPlan]  # decode rows first, then rows verifying drafts, then prefill chunks
    num_decode: int  # leading rows with exactly one new token
    logit_rows: LogitRows  # which token rows become logits (ScheduledBatch.logit_rows)
    lora: LoRARows | None  # None when no row has an adapter
    num_drafted: int = 0  # rows after the decode rows that verify drafts

    @property
    def decode_only(self) -> bool:
        return self.num_decode == len(self.rows)


def plan_step(batch: ScheduledBatch, lora: LoRARows | None) -> StepPlan:
    rows = [RowPlan(seq.num_computed_tokens, _new_tokens(seq, n), seq.block_table)
            for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]
    return StepPlan(rows, batch.num_decode, batch.logit_rows, lora, batch.num_drafted)


def _new_tokens(seq: Sequence, n: int) -> list[int]:
    """The tokens `seq` computes this step: its next n, or its last one then its drafts."""
    start = seq.num_computed_tokens
    if seq.spec_tokens:
        return seq.token_ids[start:] + seq.spec_tokens
    return seq.token_ids[start:start + n]
