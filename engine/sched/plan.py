"""One step as every rank runs it: what the model runner reads of the scheduled sequences, and
the step's adapter slots. `plan_step(batch, lora)` builds it on rank 0 from the scheduler's
batch; `ModelRunner.prepare` reads it; a tensor-parallel step broadcasts it to the worker ranks
as it is (engine/parallel/runner.py), so every rank prepares the same inputs from the same
typed message.

Columns, one entry per row, not an object per row: a decode step of a large batch is made of
a few list comprehensions, and the decode buffers are filled from the columns as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from loragw.engine.forward.lora import LoRARows
from loragw.engine.sched.batch import LogitRows, ScheduledBatch


@dataclass(frozen=True, slots=True)
class StepPlan:
    # rows: decode rows first, then rows verifying drafts, then prefill chunks
    starts: list[int]  # each row's computed tokens: the position of its first new token
    num_new: list[int]  # the tokens each row computes this step
    # those tokens, row after row (a decode row: one; a row verifying drafts: its last token,
    # then the drafts; a prefill row: its next chunk)
    tokens: list[int]
    block_tables: list[list[int]]  # each row's KV blocks (the sequence's own lists: read
    # within the step)
    num_decode: int  # leading rows with exactly one new token
    logit_rows: LogitRows  # which token rows become logits (ScheduledBatch.logit_rows)
    lora: LoRARows | None  # None when no row has an adapter
    num_drafted: int = 0  # rows after the decode rows that verify drafts

    @property
    def decode_only(self) -> bool:
        return self.num_decode == len(self.starts)


def plan_step(batch: ScheduledBatch, lora: LoRARows | None) -> StepPlan:
    seqs = batch.seqs
    starts = [seq.num_computed_tokens for seq in seqs]
    if batch.num_decode == len(seqs):  # one token each, the one after its computed ones
        tokens = [seq.token_ids[start] for seq, start in zip(seqs, starts)]
    else:
        tokens = []
        for seq, start, n in zip(seqs, starts, batch.num_new_tokens, strict=True):
            # its next n tokens, or its last one then its drafts
            tokens.extend(seq.token_ids[start:] + seq.spec_tokens if seq.spec_tokens
                          else seq.token_ids[start:start + n])
    return StepPlan(starts, batch.num_new_tokens, tokens, [seq.block_table for seq in seqs],
                    batch.num_decode, batch.logit_rows, lora, batch.num_drafted)
