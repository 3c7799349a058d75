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

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from loragw.engine.config import Config
from loragw.engine.request.sequence import PENDING, Sequence, TokenLogprob
from loragw.engine.request.token_mask import TokenMask
from loragw.engine.runner.sampler import Sampler
from loragw.engine.sched.batch import ScheduledBatch
from loragw.engine.spec.goodput import (
    ADAPTER_DECAY,
    PROBE_EVERY,
    START_RATE,
    Acceptance,
    StepCosts,
    choose_lengths,
)
from loragw.engine.spec.proposer import Proposer, make_proposer
from loragw.engine.spec.verify import NewTokens, sample_plain, verify
from loragw.engine.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    from loragw.engine.runner.model_runner import StepLogits

@dataclass(slots=True)
class SpecCounts:
    """Per adapter (None: the base): vLLM's spec_decode counters, and the draft lengths the
    goodput model chose (engine/spec/goodput.py)."""

    drafts: int = 0  # verification rows (sequences that proposed, per step)
    draft_tokens: int = 0  # tokens proposed
    accepted_tokens: int = 0  # of those, kept
    choices: int = 0  # decoding rows a length was chosen for (0 included)
    chosen_tokens: int = 0  # the lengths chosen, summed (mean k = chosen_tokens / choices)


@dataclass(slots=True)
class RowState:
    """What the Speculator keeps of one request between steps."""

    acceptance: Acceptance = field(default_factory=Acceptance)
    shadow: tuple[int, int] | None = None  # (position, token) a free first draft predicted
    quiet: int = 0  # steps since it last verified a draft (probes: engine/spec/goodput.py)


class Speculator:
    def __init__(self, config: SpeculativeConfig, target: Config, num_kv_blocks: int,
                 vocab_size: int):
        self.config = config
        self.counts: dict[str | None, SpecCounts] = {}
        self.proposer: Proposer = make_proposer(config, target, num_kv_blocks, vocab_size)
        self.draft_probs: dict[int, Tensor] = {}  # seq_id -> q [k, V] of a sampled row's drafts
        self.rows: dict[int, RowState] = {}  # seq_id -> its acceptance, shadow draft, probe clock
        self.pooled: dict[str | None, Acceptance] = {}  # adapter -> every request's, the prior
        self.costs = StepCosts()

    def close(self) -> None:
        self.proposer.close()

    def propose(self, running: Iterable[Sequence], sampler: Sampler) -> None:
        """Set every running sequence's drafts for this step ([] for none): decoding sequences
        that allow it get the lengths engine/spec/goodput.py chooses (0 included), never more
        than num_speculative_tokens, and none when more than disable_by_batch_size decode
        (a hard limit when set; by default the model alone decides)."""
        running = list(running)
        alive = {s.seq_id for s in running}
        self.proposer.forget_all_but(alive)  # preempted requests' copies (and any left over)
        if len(self.rows) > len(alive):
            self.rows = {i: r for i, r in self.rows.items() if i in alive}
        decoding = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        for seq in running:
            seq.spec_tokens = []
        self.draft_probs.clear()
        limit = self.config.disable_by_batch_size
        if limit is not None and len(decoding) > limit:
            return
        # the step emits up to k + 1 tokens: never past max_tokens
        candidates = [(seq, cap) for seq in decoding if seq.params.speculative and (cap := min(
            self.config.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1)) > 0]
        if not candidates:
            return
        seqs = [seq for seq, _ in candidates]
        states = [self._row(seq) for seq in seqs]
        free = self.proposer.free_drafts(seqs, [cap for _, cap in candidates])
        if free is not None:
            caps = [len(drafts) for drafts in free]  # no match, nothing to verify
            forced = None
        else:
            caps = [cap for _, cap in candidates]
            forced = [int(state.quiet >= PROBE_EVERY) for state in states]
        alphas = [state.acceptance.rate(self._pooled(seq.adapter).rate(START_RATE, 1.0))
                  for seq, state in zip(seqs, states)]
        ks = choose_lengths(alphas, caps, len(decoding), self.costs, forced)
        for seq, state, k in zip(seqs, states, ks):
            counts = self.counts.setdefault(seq.adapter, SpecCounts())
            counts.choices += 1
            counts.chosen_tokens += k
            state.quiet = 0 if k else state.quiet + 1
        if free is not None:
            for seq, state, drafts, k in zip(seqs, states, free, ks):
                seq.spec_tokens = drafts[:k]
                if not k and drafts:  # learnt for free: did the next token match?
                    state.shadow = (seq.num_tokens, drafts[0])
            return
        wanted = [(seq, k) for seq, k in zip(seqs, ks) if k]
        started = time.perf_counter()
        proposals = self.proposer.propose([s for s, _ in wanted], [k for _, k in wanted],
                                          sampler)
        self.costs.observe_proposal(max(ks), time.perf_counter() - started)
        for (seq, _), (drafts, q) in zip(wanted, proposals):
            seq.spec_tokens = drafts
            if q is not None:
                self.draft_probs[seq.seq_id] = q

    def measure(self, batch: ScheduledBatch, seconds: float) -> None:
        """A step's time: the cost model learns from steps of decode and verify rows only (a
        prompt chunk's time says nothing of what a draft costs)."""
        if batch.seqs and batch.num_decode + batch.num_drafted == len(batch.seqs):
            self.costs.observe(batch.num_tokens, seconds)

    def forget(self, seq: Sequence) -> None:
        """A request finished or was aborted: drop what the proposer kept of it."""
        self.proposer.forget(seq.seq_id)
        self.rows.pop(seq.seq_id, None)

    def _row(self, seq: Sequence) -> RowState:
        """seq's state, its shadow draft settled against the token that came."""
        state = self.rows.get(seq.seq_id)
        if state is None:
            state = self.rows[seq.seq_id] = RowState()
        if state.shadow is not None:
            position, token = state.shadow
            if position < seq.num_tokens and seq.token_ids[position] != PENDING:
                state.shadow = None
                self._learn(seq, int(seq.token_ids[position] == token), 1, state)
        return state

    def _pooled(self, adapter: str | None) -> Acceptance:
        pooled = self.pooled.get(adapter)
        if pooled is None:
            pooled = self.pooled[adapter] = Acceptance()
        return pooled

    def _learn(self, seq: Sequence, kept: int, drafted: int, state: RowState) -> None:
        state.acceptance.add(kept, drafted)
        self._pooled(seq.adapter).add(kept, drafted, ADAPTER_DECAY)

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
                self._learn(seqs[j], v.num_accepted, len(seqs[j].spec_tokens),
                            self._row(seqs[j]))
        return tokens, logprobs

    def _q(self, seq: Sequence) -> Tensor | None:
        """The draft distribution of seq's drafts (as many as the scheduler kept), None for a
        point mass (prompt lookup, or a greedy row)."""
        q = self.draft_probs.get(seq.seq_id)
        return None if q is None else q[:len(seq.spec_tokens)]
