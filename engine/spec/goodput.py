"""How many drafts each request proposes this step: the lengths that maximise the step's expected
goodput (tokens emitted per second), from each request's measured acceptance and the step's
measured cost at this batch (SmartSpec's model). Zero drafts is a choice like any other, so a
request whose drafts miss stops paying for them, and a batch big enough that verification costs
more than it saves proposes nothing (the batch rule, derived rather than fixed).

    alpha_j   request j's chance that a draft is kept, given the ones before it were: decayed
              counts of its verifications (and of free shadow drafts, below) over a prior that
              is its adapter's pooled rate
    E(k)      tokens a row emits with k drafts: 1 + alpha + ... + alpha^k; one more draft adds
              alpha^(k + 1)
    t(n, k*)  seconds of a step with n query tokens whose longest draft is k*: StepCosts' cost of
              n tokens (measured per token count on decode-only steps; between measured counts
              interpolated, beyond them extended at PRIOR_SLOPE) plus k* proposal steps (the
              proposer's measured seconds per drafted position)
    choose    start every row at k = 0; repeatedly make the move that raises sum(E) / t the
              most (one more draft for one row, or for every row at once); stop when none
              raises it by MIN_GAIN

A draft's acceptance is learnt where it is free: a proposer that drafts without a model (prompt
lookup) also proposes for rows that chose k = 0, and whether the next token matched its first
draft counts as one trial. A row whose proposer cannot draft for free probes with one draft
every PROBE_EVERY steps, so its rate can recover; that bounds the cost of a miss to a fraction
of one token per PROBE_EVERY steps.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

DECAY = 0.85  # per verification: a request's acceptance follows what it writes now
PRIOR_WEIGHT = 3.0  # the adapter's pooled rate counts as this many trials of a new request
ADAPTER_DECAY = 0.995  # the pooled rate forgets over a few hundred verifications
START_RATE = 0.3  # before any adapter's request has verified a draft
PRIOR_SLOPE = 0.125  # unmeasured: one more query token costs this share of a one-token step
COST_DECAY = 0.8  # per observation of the same token count: step times drift (load, threads)
PROBE_EVERY = 16
MIN_GAIN = 1.01  # a draft must raise expected goodput by 1%: noise in t never buys a loss


@dataclass(slots=True)
class Acceptance:
    """Decayed counts of kept drafts over trials (a trial ends at the first rejected draft)."""

    kept: float = 0.0
    trials: float = 0.0

    def add(self, kept: int, drafted: int, decay: float = DECAY) -> None:
        self.kept = self.kept * decay + kept
        self.trials = self.trials * decay + kept + (kept < drafted)

    def rate(self, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        return (self.kept + prior * weight) / (self.trials + weight)


@dataclass(slots=True)
class StepCosts:
    """Seconds of a decode-only step by its number of query tokens (decode rows + drafts)."""

    seconds: dict[int, float] = field(default_factory=dict)
    counts: list[int] = field(default_factory=list)  # the measured token counts, sorted
    floors: list[float] = field(default_factory=list)  # per count: the largest time up to it
    proposal: float = 0.0  # seconds per drafted position of a proposal (a draft model's step)

    def observe(self, tokens: int, seconds: float) -> None:
        old = self.seconds.get(tokens)
        if old is None:
            bisect.insort(self.counts, tokens)
            self.seconds[tokens] = seconds
        else:
            self.seconds[tokens] = COST_DECAY * old + (1 - COST_DECAY) * seconds
        # once per step here, so cost() (many calls per step) reads them in O(1)
        self.floors = list(itertools.accumulate((self.seconds[c] for c in self.counts), max))

    def observe_proposal(self, positions: int, seconds: float) -> None:
        if positions > 0:
            per = seconds / positions
            self.proposal = per if self.proposal == 0.0 else 0.8 * self.proposal + 0.2 * per

    def cost(self, tokens: int) -> float:
        """Expected seconds of a step with `tokens` query tokens; never less than a step with
        fewer (a measured dip is noise). 0.0 until any step has been measured."""
        counts = self.counts
        if not counts:
            return 0.0
        i = bisect.bisect_left(counts, tokens)
        if i < len(counts) and counts[i] == tokens:
            return self._floor(i)
        if i == 0:
            return self._floor(0)
        low = counts[i - 1]
        if i == len(counts):  # beyond every measured count: the prior's slope
            base = self._floor(i - 1)
            return base + (tokens - low) * PRIOR_SLOPE * self._unit()
        high = counts[i]
        a, b = self._floor(i - 1), self._floor(i)
        return a + (b - a) * (tokens - low) / (high - low)

    def _floor(self, i: int) -> float:
        """The measured time at counts[i], raised to the largest measured below it."""
        return self.floors[i]

    def _unit(self) -> float:
        """A one-token step's time as the smallest measured step suggests it."""
        smallest = self.counts[0]
        return self.seconds[smallest] / (1 + (smallest - 1) * PRIOR_SLOPE)


def expected_tokens(alpha: float, k: int) -> float:
    """1 + alpha + ... + alpha^k: what a row with k drafts emits on average."""
    return sum(alpha ** i for i in range(k + 1))


def choose_lengths(alphas: list[float], caps: list[int], rows: int, costs: StepCosts,
                   forced: list[int] | None = None) -> list[int]:
    """Drafts per candidate row (alphas[j], at most caps[j]) for a step of `rows` decoding rows
    (the candidates among them), maximising expected tokens per second. `forced[j]`: a
    minimum (a probe). With no step measured yet, the model's prior alone decides."""
    ks = list(forced) if forced is not None else [0] * len(alphas)
    ks = [min(k, cap) for k, cap in zip(ks, caps)]
    unit = costs.cost(1) or 1.0
    proposal = costs.proposal

    def seconds(total_drafts: int, longest: int) -> float:
        measured = costs.cost(rows + total_drafts)
        if measured == 0.0:  # nothing measured: a step of n tokens as the prior has it
            measured = unit * (1 + (rows + total_drafts - 1) * PRIOR_SLOPE)
        return measured + proposal * longest

    emitted = rows + sum(expected_tokens(a, k) - 1 for a, k in zip(alphas, ks))
    drafts, longest = sum(ks), max(ks, default=0)
    best = emitted / seconds(drafts, longest)
    while True:
        open_rows = [j for j, (k, cap, a) in enumerate(zip(ks, caps, alphas))
                     if k < cap and a > 0.0]
        if not open_rows:
            return ks
        # the moves: one more draft for one row, or for every open row at once (a draft
        # model's step serves the whole batch, so only drafting together may pay for it)
        gains = [alphas[j] ** (ks[j] + 1) for j in open_rows]
        scored = [((emitted + gain) / seconds(drafts + 1, max(longest, ks[j] + 1)), (j,))
                  for j, gain in zip(open_rows, gains)]
        if len(open_rows) > 1:
            deepest = max(ks[j] + 1 for j in open_rows)
            scored.append(((emitted + sum(gains)) / seconds(drafts + len(open_rows),
                                                             max(longest, deepest)),
                           tuple(open_rows)))
        top, picked = max(scored)
        if top <= best * MIN_GAIN:
            return ks
        for j in picked:
            emitted += alphas[j] ** (ks[j] + 1)
            ks[j] += 1
        drafts, longest, best = drafts + len(picked), max(longest, *(ks[j] for j in picked)), top
