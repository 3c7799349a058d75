"""When a request ends, and why: an EOS or stop token, a stop string, a grammar that is done,
max_tokens or the context window (vLLM's finish reasons "stop" and "length")."""

from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer
from engine.sequence import Sequence
from engine.structured import GuidedState


def ends_on_token(seq: Sequence, token: int, eos_token_ids: set[int]) -> bool:
    """Whether `token`, just appended to `seq`, is an EOS or stop token that ends it (the
    sampler masks them until min_tokens outputs, so that check is only a safeguard)."""
    params = seq.params
    return (((not params.ignore_eos and token in eos_token_ids)
             or token in params.stop_token_ids)
            and seq.num_output_tokens > params.min_tokens)


def finish_reason(seq: Sequence, token: int, ends: bool, eos_token_ids: set[int],
                  detokenizer: IncrementalDetokenizer | None, guided: GuidedState | None,
                  max_model_len: int) -> tuple[str | None, str | int | None]:
    """(finish reason or None while it goes on, stop reason: the stop token or string that
    ended it, None otherwise) after `token`; `ends`: ends_on_token's answer for it."""
    params = seq.params
    if ends:
        eos = not params.ignore_eos and token in eos_token_ids
        return "stop", None if eos else token
    if detokenizer is not None and detokenizer.stop_reason is not None:
        return "stop", detokenizer.stop_reason
    if guided is not None and guided.done:
        return "stop", None  # the grammar accepted a stop token: the output is complete
    if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        return "length", None
    return None, None
