"""What the engine keeps of one request beyond its Sequence, and how a step's new tokens are
taken into it: one at a time, as decoding without speculation would, so that a stop token,
stop string, finished grammar or max_tokens inside a run of accepted drafts ends the request
right there and the tokens after it are dropped."""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer
from engine.sequence import RequestOutput, RequestTimes, Sequence, TokenLogprob
from engine.stopping import ends_on_token, finish_reason
from engine.structured import GuidedState


@dataclass(slots=True)
class Taken:
    tokens: list[int]  # the step's tokens the request kept
    logprobs: list[TokenLogprob]
    text: str
    finish_reason: str | None  # set when the request ended on one of them


@dataclass(slots=True)
class RequestState:
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    stop_reason: str | int | None = None
    guided: GuidedState | None = None  # structured output's matcher, if params.guided
    sent_prompt_logprobs: bool = False  # its first output carried them

    def take(self, tokens: list[int], logprobs: list[TokenLogprob] | None,
             eos_token_ids: frozenset[int], max_model_len: int) -> Taken:
        """Append the step's tokens up to the first that ends the request."""
        seq, detok = self.seq, self.detokenizer
        if seq.first_token_at is None and tokens:
            seq.first_token_at = time.monotonic()
        kept, texts = [], []
        reason = None
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            kept.append(token)
            if self.guided is not None:
                self.guided.advance(token)  # the matcher accepts it on the mask thread
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
            # an ending EOS / stop token stays out of the text unless include_stop_str_in_output
            ends = ends_on_token(seq, token, eos_token_ids)
            if detok is not None and (not ends or seq.params.include_stop_str_in_output):
                texts.append(detok.step([token]))
            reason, self.stop_reason = finish_reason(seq, token, ends, eos_token_ids, detok,
                                                     self.guided, max_model_len)
            if reason is not None:
                if detok is not None:
                    texts.append(detok.flush())  # never releases a matched stop string
                break
        return Taken(kept, logprobs[:len(kept)] if logprobs is not None else [], "".join(texts),
                     reason)

    def output(self, tokens: list[int], logprobs: list[TokenLogprob], text: str) -> RequestOutput:
        seq = self.seq
        prompt = None
        if seq.prompt_logprobs is not None and not self.sent_prompt_logprobs:
            prompt, self.sent_prompt_logprobs = seq.prompt_logprobs, True  # the first output
        times = (RequestTimes(seq.arrival, seq.scheduled_at, seq.first_token_at,
                              time.monotonic(), seq.device_load) if seq.is_finished else None)
        return RequestOutput(seq.request_id, tokens, text, logprobs, seq.is_finished,
                             seq.finish_reason, self.stop_reason, seq.num_prompt_tokens,
                             seq.num_output_tokens, seq.num_cached_tokens or 0, prompt, times)
