"""Prompt logprobs (vLLM's `prompt_logprobs`; the legacy completions API's `echo` with
`logprobs`): the log-probability of each prompt token after the first, given the ones before,
from the prefill's own logits, chunk by chunk as the prompt is prefilled.

    logprob(token p+1) = log_softmax(logits at position p)[token p+1]

in float32 over the raw model logits (before logit_bias, penalties and temperature, as the
sampler's logprobs), plus the N most likely tokens at each position. The log_softmax runs over
ROWS_PER_SLICE positions at a time, so a chunk of a long prompt never holds more than that
many float32 vocabulary rows besides its logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loragw.engine.request.sequence import TokenLogprob

if TYPE_CHECKING:
    from loragw.engine.runner.model_runner import StepLogits
    from loragw.engine.sched.batch import ScheduledBatch

ROWS_PER_SLICE = 256


def prompt_logprobs(logits: torch.Tensor, targets: list[int], top_n: int) -> list[TokenLogprob]:
    """logits: [L, V] of L consecutive prompt positions; targets: the L tokens after them."""
    assert logits.shape[0] == len(targets), (logits.shape, len(targets))
    out: list[TokenLogprob] = []
    for start in range(0, len(targets), ROWS_PER_SLICE):
        rows = logits[start:start + ROWS_PER_SLICE].float()
        raw = torch.log_softmax(rows, dim=-1)  # [l, V]
        ids = targets[start:start + ROWS_PER_SLICE]
        chosen = raw.gather(1, torch.tensor(ids, device=raw.device)[:, None])  # [l, 1]
        ranks = ((raw > chosen).sum(dim=1) + 1).tolist()  # 1 + the tokens more likely
        top_lp, top_ids = (raw.topk(top_n, dim=-1) if top_n else (raw[:, :0], raw[:, :0]))
        out.extend(TokenLogprob(token, lp, list(zip(t_ids, t_lp, strict=True)), rank)
                   for token, lp, t_ids, t_lp, rank in zip(ids, chosen[:, 0].tolist(),
                                                           top_ids.tolist(), top_lp.tolist(),
                                                           ranks, strict=True))
    return out


def record_prompt_logprobs(step: StepLogits, batch: ScheduledBatch) -> None:
    """Append this step's prompt logprobs to each sequence that asked (Sequence.prompt_logprobs)."""
    for rows in step.prompt:
        seq = batch.seqs[rows.batch_row]
        targets = seq.token_ids[rows.position + 1:rows.position + 1 + rows.count]
        seq.prompt_logprobs.extend(prompt_logprobs(
            step.logits[rows.first:rows.first + rows.count], targets, seq.params.prompt_logprobs))
