"""Speculative decoding in the engine's step: proposals before scheduling, verification after
the forward pass, and the counters /metrics shows.

    step():  propose(running)      each decoding sequence gets up to k drafts (seq.spec_tokens)
             schedule               a drafted row computes [last token, drafts] (budget allowing),
                                    placed right after the decode rows
             forward                one pass; each token of a drafted row attends as a decode
                                    query of its own (the decode kernel, no prefill gather), and
                                    the row yields k + 1 logit rows
             sample(...)            plain rows through the sampler, drafted rows through verify
             settle                 K/V of the kept drafts count as computed (block manager)

Drafted rows run eagerly: they are not decode-only steps, so a CUDA decode graph never runs
them (plain decode steps keep their graphs). Under tensor parallelism they are rows of the
step's plan like any other, so every rank computes them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from loragw.engine.config import Config
from loragw.engine.request.sequence import Sequence, TokenLogprob
from loragw.engine.request.token_mask import TokenMask
from loragw.engine.runner.sampler import Sampler
from loragw.engine.spec.proposer import Proposer, make_proposer
from loragw.engine.spec.verify import NewTokens, sample_plain, verify
from loragw.engine.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    from loragw.engine.runner.model_runner import StepLogits

MAX_BACKOFF_STEPS = 16


@dataclass(slots=True)
class SpecCounts:
    """Per adapter (None: the base): vLLM's spec_decode counters."""

    drafts: int = 0  # verification rows (sequences that proposed, per step)
    draft_tokens: int = 0  # tokens proposed
    accepted_tokens: int = 0  # of those, kept


class Speculator:
    def __init__(self, config: SpeculativeConfig, target: Config, num_kv_blocks: int,
                 vocab_size: int):
        self.config = config
        self.counts: dict[str | None, SpecCounts] = {}
        self.proposer: Proposer = make_proposer(config, target, num_kv_blocks, vocab_size)
        self.draft_probs: dict[int, Tensor] = {}  # seq_id -> q [k, V] of a sampled row's drafts
        # seq_id -> [steps still to skip, the skip after the next miss]: a request whose drafts
        # were all rejected proposes nothing for 1, 2, 4 ... 16 steps, so an answer that does not
        # repeat its context stops paying for verification; a kept draft resets it
        self.backoff: dict[int, list[int]] = {}

    def close(self) -> None:
        self.proposer.close()

    def propose(self, running: Iterable[Sequence], sampler: Sampler) -> None:
        """Set every running sequence's drafts for this step ([] for none): only decoding
        sequences that allow it propose, and none when more than disable_by_batch_size
        decode (the rule: RESULTS.md)."""
        running = list(running)
        alive = {s.seq_id for s in running}
        self.proposer.forget_all_but(alive)  # preempted requests' copies (and any left over)
        if len(self.backoff) > len(alive):
            self.backoff = {i: b for i, b in self.backoff.items() if i in alive}
        decoding = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        for seq in running:
            seq.spec_tokens = []
        self.draft_probs.clear()
        if len(decoding) > self.config.disable_by_batch_size:
            decoding = []
        # the step emits up to k + 1 tokens: never past max_tokens
        ks = [min(self.config.num_speculative_tokens,
                  seq.params.max_tokens - seq.num_output_tokens - 1) for seq in decoding]
        wanted = [(seq, k) for seq, k in zip(decoding, ks)
                  if k > 0 and seq.params.speculative and not self._backing_off(seq)]
        proposals = self.proposer.propose([s for s, _ in wanted], [k for _, k in wanted],
                                          sampler)
        for (seq, _), (drafts, q) in zip(wanted, proposals):
            seq.spec_tokens = drafts
            if q is not None:
                self.draft_probs[seq.seq_id] = q

    def forget(self, seq: Sequence) -> None:
        """A request finished or was aborted: drop what the proposer kept of it."""
        self.proposer.forget(seq.seq_id)
        self.backoff.pop(seq.seq_id, None)

    def _backing_off(self, seq: Sequence) -> bool:
        state = self.backoff.get(seq.seq_id)
        if state is None or state[0] == 0:
            return False
        state[0] -= 1
        return True

    def _record(self, seq: Sequence, kept: int) -> None:
        if kept:
            self.backoff.pop(seq.seq_id, None)
            return
        state = self.backoff.setdefault(seq.seq_id, [0, 1])
        state[0], state[1] = state[1], min(2 * state[1], MAX_BACKOFF_STEPS)

    def sample(self, sampler: Sampler, step: StepLogits, seqs: list[Sequence],
               mask: TokenMask | None) -> NewTokens:
        """Each sampling sequence's new tokens (in order): plain rows sampled as always, drafted
        rows verified. `mask` rows: the plain rows, then every drafted row's k + 1."""
        logits = step.logits
        plain = [j for j, s in enumerate(seqs) if not s.spec_tokens]
        drafted = [j for j, s in enumerate(seqs) if s.spec_tokens]
        plain_mask, drafted_mask = mask.split(len(plain)) if mask is not None else (None, None)
        tokens: list[list[int]] = [[] for _ in seqs]
        logprobs: list[list[TokenLogprob] | None] = [None] * len(seqs)
        if plain:
            rows = [step.sampling[j] for j in plain]
            picked = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows)]
            for j, new, lps in zip(plain, *sample_plain(sampler, picked, [seqs[j] for j in plain],
                                                         plain_mask), strict=True):
                tokens[j], logprobs[j] = new, lps
        if drafted:
            rows = [r for j in drafted
                    for r in range(step.sampling[j] - len(seqs[j].spec_tokens),
                                   step.sampling[j] + 1)]
            verified = verify(sampler, logits[torch.tensor(rows)], [seqs[j] for j in drafted],
                              [seqs[j].spec_tokens for j in drafted],
                              [self._q(seqs[j]) for j in drafted], mask=drafted_mask)
            for j, v in zip(drafted, verified, strict=True):
                tokens[j], logprobs[j] = v.token_ids, v.logprobs
                counts = self.counts.setdefault(seqs[j].adapter, SpecCounts())
                counts.drafts += 1
                counts.draft_tokens += len(seqs[j].spec_tokens)
                counts.accepted_tokens += v.num_accepted
                self._record(seqs[j], v.num_accepted)
        return tokens, logprobs

    def _q(self, seq: Sequence) -> Tensor | None:
        """The draft distribution of seq's drafts (as many as the scheduler kept), None for a
        point mass (prompt lookup, or a greedy row)."""
        q = self.draft_probs.get(seq.seq_id)
        return None if q is None else q[:len(seq.spec_tokens)]
