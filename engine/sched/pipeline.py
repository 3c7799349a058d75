"""Async scheduling (`--async-scheduling`, vLLM's): the next step is scheduled and launched
before the host reads this step's tokens, so on a GPU the host's work of a step (schedule,
prepare, then detokenize and stop checks of the step before) runs while the device computes.

    step N+1:  schedule   prepare   launch forward + sample   read N's tokens, advance N's requests
    device:    ...... step N ......  ........................ step N+1 ........................

A sequence sampled by a step in flight holds a placeholder (`PENDING`) as its last token and
`pending` set: the scheduler counts it (the sequence decodes its next position), and the step
that computes it takes the token from the step in flight's device tensor of sampled tokens
(`PendingInputs`), never from the host. When the host reads the tokens, each placeholder is
replaced by its token through the same `RequestState.advance` a synchronous step uses: the same
stop rules, the same outputs, a step later.

Which steps stay in flight: those whose every sampling row `pipelines` (SamplingParams: no
penalties, logprobs, prompt logprobs or grammar, whose next step needs this step's tokens on
the host), without speculative decoding or tensor parallelism (refused with the option). Any
other step is read at once, as without the option. A request that ends on the token in flight
was scheduled into the next step anyway: that row's token is dropped (one row of work, as in
vLLM); one that ends by length is not scheduled again (its last position is known).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from loragw.engine.request.sequence import PENDING, Sequence, SequenceStatus
from loragw.engine.sched.batch import ScheduledBatch
from loragw.kernels.meta import host_to_device


@dataclass(slots=True)
class PendingInputs:
    """Input tokens of a step that the step in flight samples: token row rows[i] of the step's
    flat batch is tokens[sources[i]] (on the device; the host's copy holds PENDING)."""

    rows: list[int]
    sources: list[int]
    tokens: Tensor  # [S] int64: the step in flight's sampled tokens

    def write(self, input_ids: Tensor) -> None:
        index = host_to_device([self.rows, self.sources], input_ids.device)  # [2, P]
        input_ids[index[0]] = self.tokens[index[1]]


class InFlight:
    """A launched step whose sampled tokens the host has not read: its sampling sequences and
    their tokens on the device, with the copy to the host already queued behind them."""

    def __init__(self, seqs: list[Sequence], tokens: Tensor):
        self.seqs, self.tokens = seqs, tokens  # tokens: [len(seqs)] int64
        self.host, self.ready = tokens, None
        if tokens.device.type == "cuda":  # queued now: read back as soon as the step ends
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        self.index = {seq: row for row, seq in enumerate(seqs)}

    def hold(self) -> None:
        """Give each sequence still running its placeholder (one ended by the step read since
        is dropped: its token here is never read)."""
        for seq in self.seqs:
            if seq.status is SequenceStatus.RUNNING:
                seq.token_ids.append(PENDING)
                seq.pending = True

    def inputs(self, batch: ScheduledBatch) -> PendingInputs | None:
        """Which of `batch`'s token rows are this step's tokens (pending sequences decode, so
        they are among its leading one-token rows)."""
        rows, sources, index = [], [], self.index
        for row, seq in enumerate(batch.seqs[:batch.num_decode]):
            if seq.pending:
                rows.append(row)
                sources.append(index[seq])
        return PendingInputs(rows, sources, self.tokens) if rows else None

    def take(self) -> tuple[list[Sequence], list[int]]:
        """Wait for the tokens; the sequences still waiting for theirs (placeholders dropped,
        ready for `advance`) and their tokens."""
        if self.ready is not None:
            self.ready.synchronize()
        seqs, tokens = [], []
        for seq, token in zip(self.seqs, self.host.tolist()):
            if seq.pending:  # else it ended (or was aborted) since: nothing to read
                drop_pending(seq)
                seqs.append(seq)
                tokens.append(token)
        return seqs, tokens


def drop_pending(seq: Sequence) -> None:
    """Remove `seq`'s placeholder (its token is being taken, or the request ended)."""
    if seq.pending:
        seq.token_ids.pop()
        seq.pending = False
