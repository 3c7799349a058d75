"""Continuous batching: a waiting queue, a running queue, and a per-step token budget.

Each step the running sequences go first (one token each when decoding, the next chunk when
their prompt is still being prefilled), then waiting sequences are admitted while the token
budget, `max_num_seqs`, KV blocks and adapter slots allow. An admitted sequence first shares
the longest run of its full blocks already in the prefix cache (same tokens, same adapter
version) and computes only the rest. A prompt larger than the budget is prefilled in chunks
across steps. While any sequence decodes, a step's prompt tokens are capped further, at
`max_prefill_decoding`: a step's time grows with its prefill tokens, and every decoding stream
waits for the whole step, so the cap bounds a running stream's worst gap between two tokens.
With nothing decoding there is nothing to delay, and the full budget applies.

When KV blocks run out, the most recently admitted running sequence is preempted: its blocks
are freed and it is recomputed later from its tokens (sharing what of them is still cached).

Adapter slots and aging. A waiting sequence whose adapter has no slot is skipped and the ones
behind it go ahead, so a busy resident adapter could keep its slot forever. Every step a
sequence is skipped for want of a slot counts against it; once the longest-waiting one has
waited `lora_starvation_steps` steps, the slot policy names one resident adapter (the slot that
will go idle soonest; one holding a full-module slot when the waiting adapter needs one) which
then admits no new sequences until that slot has drained and been handed over. Running
sequences are never preempted or moved for this; the rest are admitted in arrival order.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Protocol

from loragw.engine.kv.block_manager import BlockManager
from loragw.engine.request.sequence import Sequence, SequenceStatus
from loragw.engine.sched.batch import ScheduledBatch

logger = logging.getLogger(__name__)


class SlotPolicy(Protocol):
    """Adapter slot admission (the LoRA manager); a sequence runs only while it holds one."""

    def acquire(self, seq: Sequence) -> bool: ...
    def release(self, seq: Sequence) -> None: ...
    def finished(self, seq: Sequence) -> None: ...

    def version(self, adapter: str) -> int:
        """The version of `adapter`'s weights that acquire() would run a sequence with now."""

    def drain_for(self, waited: int, adapter: str) -> str | None:
        """The resident adapter that should admit no new sequences, so that its slot drains for
        a sequence of `adapter` refused a slot in `waited` steps; None while no slot need drain."""


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int,
                 block_manager: BlockManager, slots: SlotPolicy | None = None,
                 max_prefill_decoding: int | None = None):
        """max_prefill_decoding: prompt tokens a step while one decodes (None: the budget)."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_decoding = max_prefill_decoding or max_num_batched_tokens
        self.block_manager = block_manager
        self.slots = slots
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        # Waiting sequences skipped for want of an adapter slot -> steps skipped so far.
        self.slot_waits: dict[Sequence, int] = {}
        self.draining: str | None = None  # the adapter admitting no one this step (aging)

    def add(self, seq: Sequence) -> None:
        # The engine checked that the whole request fits the cache, so preemption always ends.
        assert self.block_manager.peak_blocks(seq.num_prompt_tokens + seq.params.max_tokens) \
            <= self.block_manager.num_blocks
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        decode: list[Sequence] = []  # rows of one new token
        chunks: list[tuple[Sequence, int]] = []  # rows verifying drafts, prompt chunks
        preempted = False
        running = list(self.running)
        decoding = any(s.num_tokens - s.num_computed_tokens == 1 for s in running)
        prefill_budget = self.max_prefill_decoding if decoding else budget
        grow = self.block_manager.grow
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if seq.pending and seq.num_tokens >= seq.num_prompt_tokens + seq.params.max_tokens:
                i += 1  # the token in flight is its last (async scheduling): nothing to compute
                continue
            remaining = seq.num_tokens - seq.num_computed_tokens
            # a prompt (or a preempted sequence's recompute), or drafts to verify
            chunked = remaining != 1 or seq.spec_tokens
            num_new = self._chunk(seq, remaining, budget, prefill_budget) if chunked else 1
            if num_new == 0:  # no prefill budget left this step: it waits for the next
                i += 1
                continue
            while not grow(seq, seq.num_computed_tokens + num_new):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                if num_new == 1:
                    decode.append(seq)
                else:
                    chunks.append((seq, num_new))
                budget -= num_new
                if remaining > 1:
                    prefill_budget -= num_new
                i += 1
        self.running = deque(running)

        # Admit new work only when nothing had to be preempted this step (it would thrash).
        self._age()
        skipped: list[Sequence] = []
        while (self.waiting and min(budget, prefill_budget) > 0 and not preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            seq.set_cache_key(self._cache_key(seq))
            cached = self.block_manager.match(seq)
            num_computed = len(cached) * self.block_manager.block_size
            num_new = min(seq.num_tokens - num_computed, budget, prefill_budget)
            if not self.block_manager.can_allocate(seq, num_computed + num_new, cached):
                break
            self.waiting.popleft()
            if not self._takes_slot(seq):
                skipped.append(seq)  # its adapter has no slot yet; let others go ahead
                self.slot_waits[seq] = self.slot_waits.get(seq, 0) + 1
                continue
            self.slot_waits.pop(seq, None)
            self.block_manager.allocate(seq, num_computed + num_new, cached)
            seq.status = SequenceStatus.RUNNING
            if seq.scheduled_at is None:  # its queueing ends here (a preempted one's did)
                seq.scheduled_at = time.monotonic()
            self.running.append(seq)
            if num_new == 1:
                decode.append(seq)
            else:
                chunks.append((seq, num_new))
            budget -= num_new
            prefill_budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return self._order(decode, chunks)

    @staticmethod
    def _chunk(seq: Sequence, remaining: int, budget: int, prefill_budget: int) -> int:
        """The tokens a running row that is not a plain decode computes this step: the next
        chunk of its prompt as the budgets allow, or its last token and as many of its drafts
        as the budget allows (the rest are dropped). 0: none this step (drafts dropped)."""
        prefilling = remaining > 1
        wanted = remaining + (0 if prefilling else len(seq.spec_tokens))
        num_new = min(wanted, budget, prefill_budget if prefilling else wanted)
        if seq.spec_tokens:
            seq.spec_tokens = [] if prefilling or not num_new else seq.spec_tokens[:num_new - 1]
        return num_new

    def _age(self) -> None:
        """Pick this step's draining adapter from the longest wait for a slot (see above)."""
        longest, waited = max(self.slot_waits.items(), key=lambda item: item[1],
                              default=(None, 0))
        draining = (self.slots.drain_for(waited, longest.adapter)
                    if self.slots is not None and waited else None)
        if draining is not None and draining != self.draining:
            logger.info("adapter %s admits no new requests until its slot drains: a request "
                        "has waited %d steps for a slot", draining, waited)
        self.draining = draining

    def _cache_key(self, seq: Sequence) -> tuple[str, int] | None:
        """The weights `seq` would run with if admitted now, which its KV blocks then hold."""
        if seq.adapter is None:
            return None
        if seq.adapter_version:  # it runs on the version it started on, to its end
            return seq.adapter, seq.adapter_version
        return seq.adapter, self.slots.version(seq.adapter) if self.slots is not None else 0

    def _takes_slot(self, seq: Sequence) -> bool:
        if self.slots is None or seq.adapter is None:
            return True
        return seq.adapter != self.draining and self.slots.acquire(seq)

    @staticmethod
    def _order(decode: list[Sequence], chunks: list[tuple[Sequence, int]]) -> ScheduledBatch:
        """Decode rows (one new token) first, then rows verifying drafts, then the rest, each
        in scheduling order."""
        if not chunks:  # a decode step: the common one
            return ScheduledBatch(decode, [1] * len(decode), num_decode=len(decode))
        drafted = [(s, n) for s, n in chunks if s.spec_tokens]
        rest = drafted + [(s, n) for s, n in chunks if not s.spec_tokens]
        return ScheduledBatch(decode + [s for s, _ in rest], [1] * len(decode) + [n for _, n in rest],
                              num_decode=len(decode), num_drafted=len(drafted))

    def drop_waiting(self, adapter: str) -> list[Sequence]:
        """Retire every waiting sequence of `adapter` (its weights cannot be had); returns them."""
        dropped = [seq for seq in self.waiting if seq.adapter == adapter]
        for seq in dropped:
            self.finish(seq, "abort")
        return dropped

    def _preempt(self, seq: Sequence) -> None:
        seq.spec_tokens = []
        self.block_manager.free(seq)
        if self.slots is not None:
            self.slots.release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (finished or aborted) and free its blocks and slot at once."""
        if seq.status == SequenceStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.slot_waits.pop(seq, None)
        self.block_manager.free(seq)
        if self.slots is not None and seq.status == SequenceStatus.RUNNING:
            self.slots.release(seq)
        if self.slots is not None:
            self.slots.finished(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
