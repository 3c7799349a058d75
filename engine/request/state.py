"""What the engine keeps of one request beyond its Sequence, and how a step's new tokens are
taken into it: one at a time, as decoding without speculation would, so that a stop token,
stop string, finished grammar or max_tokens inside a run of accepted drafts ends the request
right there and the tokens after it are dropped."""

from __future__ import annotations

import time
from dataclasses import dataclass

from loragw.engine.request.detokenizer import IncrementalDetokenizer
from loragw.engine.request.sequence import RequestOutput, RequestTimes, Sequence, TokenLogprob
from loragw.engine.request.stops import StopRule
from loragw.engine.request.structured import GuidedState


@dataclass(slots=True)
class RequestState:
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    stop: StopRule
    stop_reason: str | int | None = None
    guided: GuidedState | None = None  # structured output's matcher, if params.guided
    sent_prompt_logprobs: bool = False  # its first output carried them

    def advance(self, tokens: list[int], logprobs: list[TokenLogprob] | None) -> RequestOutput:
        """Append the step's tokens up to the first that ends the request; the step's output
        (`finished` when one ended it: the engine then retires the sequence)."""
        seq, detok, guided, rule = self.seq, self.detokenizer, self.guided, self.stop
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
        token_ids = seq.token_ids
        text, reason, kept = "", None, len(tokens)
        for i, token in enumerate(tokens):
            token_ids.append(token)
            if guided is not None:
                guided.advance(token)  # the matcher accepts it on the mask thread
            # an ending EOS / stop token stays out of the text unless include_stop_str_in_output
            if token in rule.stop_ids and len(token_ids) > rule.min_total:
                if detok is not None and rule.include_stop:
                    text += detok.step_token(token)
                reason, self.stop_reason = "stop", rule.stop_reason(token)
            else:
                if detok is not None:
                    text += detok.step_token(token)
                    if detok.stop_reason is not None:
                        reason, self.stop_reason = "stop", detok.stop_reason
                if reason is None and guided is not None and guided.done:
                    reason = "stop"  # the grammar accepted a stop token: the output is complete
                if reason is None and len(token_ids) >= rule.max_total:
                    reason = "length"
            if reason is not None:
                if detok is not None:
                    text += detok.flush()  # never releases a matched stop string
                kept = i + 1
                break
        if kept < len(tokens):
            tokens = tokens[:kept]
        if logprobs is None:
            logprobs = []
        else:
            logprobs = logprobs[:kept]
            seq.logprobs.extend(logprobs)
        return self.output(tokens, logprobs, text, reason)

    def output(self, tokens: list[int], logprobs: list[TokenLogprob], text: str,
               reason: str | None = None) -> RequestOutput:
        """The output of a step that added `tokens` and ended the request for `reason` (None:
        it goes on, or had ended already: an abort)."""
        seq = self.seq
        reason = reason or seq.finish_reason
        prompt = None
        if seq.prompt_logprobs is not None and not self.sent_prompt_logprobs:
            prompt, self.sent_prompt_logprobs = seq.prompt_logprobs, True  # the first output
        times = (None if reason is None else RequestTimes(
            seq.arrival, seq.scheduled_at, seq.first_token_at, time.monotonic(), seq.device_load))
        return RequestOutput(seq.request_id, tokens, text, logprobs, reason is not None, reason,
                             self.stop_reason, seq.num_prompt_tokens,
                             len(seq.token_ids) - seq.num_prompt_tokens,
                             seq.num_cached_tokens or 0, prompt, times)
