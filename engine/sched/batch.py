"""What the scheduler hands a step: the scheduled sequences with their new-token counts
(`ScheduledBatch`), and which token rows of the step become logits (`LogitRows`): the rows that
sample, and those whose prompt logprobs were asked for (`PromptRows`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from loragw.engine.request.sequence import Sequence


@dataclass(frozen=True, slots=True)
class PromptRows:
    """Logit rows of one sequence that give prompt logprobs: rows [first, first + count) of
    the step's logits hold positions [position, position + count), each the logprob of the
    prompt token after it."""

    batch_row: int  # the sequence's index in the batch
    first: int
    position: int
    count: int


@dataclass(frozen=True, slots=True)
class LogitRows:
    """Which rows of the step's flat token batch become logits, and what each is for."""

    rows: list[int]  # token rows of the step (decode rows first), in batch order
    sampling: list[int]  # indices into `rows` that sample, one per sampling sequence
    prompt: list[PromptRows]


@dataclass(slots=True)
class ScheduledBatch:
    # decode rows first, then rows verifying drafts, then prefill rows
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_decode: int = 0  # leading rows with exactly one new token
    num_drafted: int = 0  # the rows after them that verify drafts (speculative decoding)
    _logit_rows: LogitRows | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Row i reaches the end of its tokens (and drafts) this step, so its last logits
        yield a token."""
        seq = self.seqs[i]
        return (seq.num_computed_tokens + self.num_new_tokens[i]
                == seq.num_tokens + len(seq.spec_tokens))

    def logit_range(self, i: int) -> range:
        """Which of row i's new tokens (offsets into them) need logits this step: its last if it
        samples (with drafts, its last token's and every draft's); from the first prompt token still lacking a logprob, if it asked for prompt
        logprobs (the hidden state at position p gives the logprob of token p + 1)."""
        seq, n = self.seqs[i], self.num_new_tokens[i]
        start = n - 1 - len(seq.spec_tokens) if self.samples(i) else n
        if seq.needs_prompt_logprobs:
            first = max(seq.num_computed_tokens, len(seq.prompt_logprobs) - 1)
            if first < min(seq.num_computed_tokens + n, seq.num_prompt_tokens - 1):
                start = min(start, first - seq.num_computed_tokens)
        return range(start, n)

    def sampling_seqs(self) -> list[Sequence]:
        """The sequences that sample this step, in batch order (each samples once at most)."""
        every = len(self.logit_rows.sampling) == len(self.seqs)
        return list(self.seqs) if every else [s for i, s in enumerate(self.seqs) if self.samples(i)]

    @property
    def logit_rows(self) -> LogitRows:
        """Every row's logit_range, as rows of the step's flat token batch; made once per step
        (the LoRA pool picks lm_head's slots by it, the model runner its logits)."""
        if self._logit_rows is None:
            self._logit_rows = self._find_logit_rows()
        return self._logit_rows

    def _find_logit_rows(self) -> LogitRows:
        seqs = self.seqs
        # Decoding: every row's one new token is its last, so every row samples, and none has
        # prompt logprobs left (its prompt's last logits were a step before).
        if self.num_decode == len(seqs) and all(
                s.num_computed_tokens + 1 == s.num_tokens for s in seqs):
            every = list(range(len(seqs)))
            return LogitRows(every, every, [])
        rows, sampling, prompt = [], [], []
        row = 0
        for i, (seq, num_new) in enumerate(zip(seqs, self.num_new_tokens)):
            wanted = self.logit_range(i)
            if wanted:
                if seq.needs_prompt_logprobs:  # every wanted row but a sampling one
                    count = len(wanted) - self.samples(i)
                    prompt.append(PromptRows(i, len(rows),
                                             seq.num_computed_tokens + wanted.start, count))
                rows.extend(row + o for o in wanted)
                if self.samples(i):
                    sampling.append(len(rows) - 1)
            row += num_new
        return LogitRows(rows, sampling, prompt)
