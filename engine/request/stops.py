"""When a request ends, and why: an EOS or stop token, a stop string, a grammar that is done,
max_tokens or the context window (vLLM's finish reasons "stop" and "length").

Decided once per request, when it is queued (`StopRule.of`), as sets and token counts: every
row of every step asks (RequestState.advance), so a check is a set lookup and two integer
compares."""

from __future__ import annotations

from dataclasses import dataclass

from loragw.engine.request.params import SamplingParams


@dataclass(frozen=True, slots=True)
class StopRule:
    stop_ids: frozenset[int]  # tokens that end it: EOS (unless ignore_eos) and stop_token_ids
    eos_ids: frozenset[int]  # those of them that are EOS (an EOS ending has no stop reason)
    # a stop token ends it only once it has more than min_tokens outputs: more than this many
    # tokens in all (the sampler masks them until then, so this is only a safeguard)
    min_total: int
    max_total: int  # tokens in all at which it ends for length (max_tokens or the window)
    include_stop: bool  # include_stop_str_in_output: an ending token's text stays in

    @classmethod
    def of(cls, params: SamplingParams, num_prompt_tokens: int, eos_token_ids: frozenset[int],
           max_model_len: int) -> StopRule:
        """params.max_tokens must be set (the engine fills it in for requests without one)."""
        eos = frozenset() if params.ignore_eos else eos_token_ids
        # (most requests share one set, which every row of a step then finds in cache)
        stop = eos | frozenset(params.stop_token_ids) if params.stop_token_ids else eos
        return cls(stop, eos,
                   num_prompt_tokens + params.min_tokens,
                   min(num_prompt_tokens + params.max_tokens, max_model_len),
                   params.include_stop_str_in_output)

    def stop_reason(self, token: int) -> int | None:
        """The stop reason of an ending on `token`: the stop token, None for an EOS."""
        return None if token in self.eos_ids else token
