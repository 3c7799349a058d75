"""Speculative decoding in the engine's step: proposals before scheduling, verification after
the forward pass, and the counters /metrics shows.

    step():  propose(running)      each decoding sequence gets up to k drafts (seq.spec_tokens)
             schedule               a drafted row computes [last token, drafts] (budget allowing)
             forward                one pass; a drafted row yields k + 1 logit rows
             sample(...)            plain rows through the sampler, drafted rows through verify
             settle                 K/V of the kept drafts count as computed (block manager)

Drafted rows run eagerly: they are not decode-only steps, so a CUDA decode graph never runs
them (plain decode steps keep their graphs). Under tensor parallelism they are rows of the
step's plan like any other, so every rank computes them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.sampler import Sampler
from engine.sequence import Sequence
from engine.spec.ngram import NgramProposer
from engine.spec.verify import Verified, verify
from engine.speculative_config import SpeculativeConfig
from engine.structured import TokenMask

if TYPE_CHECKING:
    from engine.model_runner import StepLogits


@dataclass(slots=True)
class SpecCounts:
    """Per adapter (None: the base): vLLM's spec_decode counters."""

    drafts: int = 0  # verification rows (sequences that proposed, per step)
    draft_tokens: int = 0  # tokens proposed
    accepted_tokens: int = 0  # of those, kept


@dataclass
class Speculator:
    config: SpeculativeConfig
    counts: dict[str | None, SpecCounts] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.config.method != "ngram":
            raise ValueError(f"speculative method {self.config.method!r} is not served yet")
        self.proposer = NgramProposer(self.config.prompt_lookup_min,
                                      self.config.prompt_lookup_max)

    def propose(self, running: Iterable[Sequence]) -> None:
        """Set every running sequence's drafts for this step ([] for none): only decoding
        sequences that allow it propose, and none when more than disable_by_batch_size
        decode (the rule: RESULTS.md)."""
        running = list(running)
        decoding = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        off = len(decoding) > self.config.disable_by_batch_size
        histories = self.proposer.histories
        if len(histories) > 2 * len(running):  # finished and aborted requests' copies
            alive = {s.seq_id for s in running}
            for seq_id in [i for i in histories if i not in alive]:
                del histories[seq_id]
        for seq in running:
            seq.spec_tokens = []
        if off:
            return
        for seq in decoding:
            p = seq.params
            # the step emits up to k + 1 tokens: never past max_tokens
            k = min(self.config.num_speculative_tokens, p.max_tokens - seq.num_output_tokens - 1)
            if k > 0 and p.speculative:
                seq.spec_tokens = self.proposer.propose(seq, k)

    def sample(self, sampler: Sampler, step: StepLogits, seqs: list[Sequence],
               mask: TokenMask | None) -> list[Verified]:
        """One Verified per sampling sequence (in order): plain rows sampled as always, drafted
        rows verified. `mask` rows: the plain rows, then every drafted row's k + 1."""
        logits = step.logits
        plain = [j for j, s in enumerate(seqs) if not s.spec_tokens]
        drafted = [j for j, s in enumerate(seqs) if s.spec_tokens]
        plain_mask, drafted_mask = mask.split(len(plain)) if mask is not None else (None, None)
        results: list[Verified | None] = [None] * len(seqs)
        if plain:
            rows = [step.sampling[j] for j in plain]
            picked = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows)]
            out = sampler(picked, [seqs[j] for j in plain], plain_mask)
            for j, token, logprob in zip(plain, out.token_ids, out.logprobs, strict=True):
                results[j] = Verified([token], None if logprob is None else [logprob], 0)
        if drafted:
            rows = [r for j in drafted
                    for r in range(step.sampling[j] - len(seqs[j].spec_tokens),
                                   step.sampling[j] + 1)]
            verified = verify(sampler, logits[torch.tensor(rows)], [seqs[j] for j in drafted],
                              [seqs[j].spec_tokens for j in drafted], mask=drafted_mask)
            for j, v in zip(drafted, verified, strict=True):
                results[j] = v
                counts = self.counts.setdefault(seqs[j].adapter, SpecCounts())
                counts.drafts += 1
                counts.draft_tokens += len(seqs[j].spec_tokens)
                counts.accepted_tokens += v.num_accepted
        return results
