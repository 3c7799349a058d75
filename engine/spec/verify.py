"""Verification: which proposed tokens a sequence keeps, decided from the target's own logits,
so that the output is the target's exactly.

A sequence with drafts d_1..d_k was run on [last token, d_1..d_k] in one step, giving k + 1
logit rows: row i scores the token after d_i (row 0 the one after the last token). Row i is
processed (grammar mask, token edits, penalties) as if d_1..d_i had been accepted already
(`DraftView`), exactly what decoding without speculation would have done at that point.

    greedy:  t_i = argmax(row i); keep d_{i+1} while d_{i+1} == t_i; then emit t_i
             (the correction at the first mismatch, or the bonus token when all k matched)
    sampled: p_i = the row's sampling distribution (temperature, top-k/p, min-p), q_i the
             proposer's (a point mass on d_{i+1} for prompt lookup). Keep d_{i+1} with
             probability min(1, p_i(d) / q_i(d)); at the first rejection emit a token drawn
             from normalize(max(p_i - q_i, 0)); when all k are kept, draw the bonus from p_k.

The rule (Leviathan et al. 2023, Chen et al. 2023) emits each token with the target's
probability whatever q is. Random draws come from the row's own generator when it is seeded,
so a seeded request repeats itself (given the same proposals).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from loragw.engine.request.sequence import Sequence, TokenLogprob
from loragw.engine.request.token_mask import TokenMask
from loragw.engine.runner.sampler import Sampler, argmax_rows, draw, gather_logprobs


class DraftView:
    """A sequence as it would stand with `accepted` of its drafts appended: what the sampler
    reads of a row (params, token_ids, output_token_ids, num_output_tokens, generator)."""

    __slots__ = ("seq", "accepted", "params", "generator")

    def __init__(self, seq: Sequence, accepted: list[int]):
        self.seq, self.accepted = seq, accepted
        self.params, self.generator = seq.params, seq.generator

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.accepted

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.accepted

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.accepted)


@dataclass(slots=True)
class Verified:
    token_ids: list[int]  # the kept drafts, then the target's own token: 1 to k + 1 of them
    logprobs: list[TokenLogprob] | None  # one per token, when the request asked for logprobs
    num_accepted: int  # drafts kept


# A step's new tokens, per sampling sequence: its tokens, and their logprobs (None unless the
# request asked for them)
NewTokens = tuple[list[list[int]], list[list[TokenLogprob] | None]]


def sample_plain(sampler: Sampler, logits: Tensor, seqs: list[Sequence],
                 mask: TokenMask | None) -> NewTokens:
    """Rows without drafts: one sampled token each (logits: [len(seqs), V])."""
    out = sampler(logits, seqs, mask)
    logprobs = out.logprobs
    return ([[token] for token in out.token_ids],
            logprobs if logprobs.count(None) == len(logprobs)  # (none asked: most steps)
            else [None if logprob is None else [logprob] for logprob in logprobs])


@torch.inference_mode()
def verify(sampler: Sampler, logits: Tensor, seqs: list[Sequence], drafts: list[list[int]],
           draft_probs: list[Tensor | None] | None = None,
           mask: TokenMask | None = None) -> list[Verified]:
    """logits: [sum(k_j + 1), V] float32, sequence j's k_j + 1 rows in order. draft_probs[j]:
    [k_j, V] the proposer's distribution at each draft (None: a point mass on the draft).
    `mask` rows index the logit rows. One Verified per sequence."""
    views = [DraftView(seq, d[:i]) for seq, d in zip(seqs, drafts, strict=True)
             for i in range(len(d) + 1)]
    assert logits.shape[0] == len(views), (logits.shape, len(views))
    processed = sampler.process(logits, views, mask)
    greedy_tokens = argmax_rows(processed).tolist()
    sampled_rows = [r for r, v in enumerate(views) if not v.params.greedy]
    probs = (sampler.probs(processed[sampled_rows].float(), [views[r] for r in sampled_rows])
             if sampled_rows else None)
    prob_row = {r: i for i, r in enumerate(sampled_rows)}

    results, first = [], 0
    for j, (seq, d) in enumerate(zip(seqs, drafts)):
        if seq.params.greedy:
            targets = greedy_tokens[first:first + len(d) + 1]
            kept = 0
            while kept < len(d) and d[kept] == targets[kept]:
                kept += 1
            tokens = d[:kept] + [targets[kept]]
        else:
            rows = probs[[prob_row[first + i] for i in range(len(d) + 1)]]  # [k + 1, V]
            q = draft_probs[j] if draft_probs is not None else None
            tokens = _rejection_sample(rows, d, q, sampler.generator(seq, rows.device))
            kept = len(tokens) - 1
        logprobs = None
        if seq.params.logprobs is not None:
            raw = torch.log_softmax(logits[first:first + len(tokens)].float(), dim=-1)
            logprobs = gather_logprobs(raw, tokens, list(range(len(tokens))),
                                       [seq.params] * len(tokens))
        results.append(Verified(tokens, logprobs, kept))
        first += len(d) + 1
    return results


def _rejection_sample(p: Tensor, drafts: list[int], q: Tensor | None,
                      generator: torch.Generator) -> list[int]:
    """p: [k + 1, V] the target's distributions, q: [k, V] the proposer's (None: point masses on
    the drafts). Returns the kept drafts and one token of the target's own."""
    device = generator.device
    uniforms = torch.rand(len(drafts), generator=generator, device=device).tolist()
    for i, (d, u) in enumerate(zip(drafts, uniforms)):
        p_d = float(p[i, d])
        q_d = 1.0 if q is None else float(q[i, d])
        if u * q_d < p_d:  # u < p/q: kept with probability min(1, p/q)
            continue
        if q is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - q[i].to(p.dtype)).clamp_(min=0.0)
        if not bool((residual > 0).any()):  # p == q up to rounding: nothing to correct towards
            residual = p[i]
        return drafts[:i] + [draw(residual, generator)]
    return list(drafts) + [draw(p[len(drafts)], generator)]
