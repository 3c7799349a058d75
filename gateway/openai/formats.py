"""How an endpoint shapes engine increments: SSE chunks for a stream, or one whole response,
in OpenAI's shapes. `Format` is the interface streaming.py drives, and what every endpoint's
format shares; completions are format_completions.py's, chat format_chat.py's, the Responses
API responses_format.py's. A Format reads a job's choices and never changes them: the finish
reason it shows is its own `finish_reason`."""

from __future__ import annotations

import time

from msgspec import UNSET, UnsetType

from loragw.engine.api import RequestOutput, TokenLogprob, TokenText
from loragw.gateway.http.jobs import Choice, TokenCounts
from loragw.gateway.http.response_bodies import (
    SSE_DONE,
    ErrorBody,
    ErrorResponse,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    Usage,
    sse,
)


def usage(counts: TokenCounts) -> Usage:
    return Usage(prompt_tokens=counts.prompt, completion_tokens=counts.completion,
                 total_tokens=counts.prompt + counts.completion,
                 prompt_tokens_details=PromptTokensDetails(counts.cached))


class Format:
    """How an endpoint shapes increments: chunks for a stream, or one whole response."""

    def __init__(self, response_id: str, model: str, token_text: TokenText, logprobs: bool,
                 prompt_logprobs: bool = False):
        self.id, self.model, self.token_text = response_id, model, token_text
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs  # vLLM's field asked for
        self.created = int(time.time())

    def head(self, choices: list[Choice]) -> list:
        return []

    def delta(self, choice: Choice, out: RequestOutput):
        raise NotImplementedError

    def finish_reason(self, choice: Choice) -> str | None:
        """The finish_reason the client sees for a finished choice."""
        return choice.finish_reason

    def finish(self, choice: Choice):
        raise NotImplementedError

    def usage_chunk(self, counts: TokenCounts):
        """The stream_options.include_usage chunk: no choices, just usage."""
        return self._chunk([], usage(counts))

    def _chunk(self, choices: list, usage: Usage | None = None):
        raise NotImplementedError

    def whole(self, choices: list[Choice], parts: dict[int, list[RequestOutput]],
              counts: TokenCounts):
        raise NotImplementedError

    # ---- the stream's framing (stream_sse): OpenAI's `data:` events and `data: [DONE]` -------
    def encode(self, chunk) -> bytes:
        """One chunk on the wire."""
        return sse(chunk)

    def failure(self, message: str):
        """What a stream that fails after its headers went out says, in-band."""
        return ErrorResponse(ErrorBody(message=message, type="server_error",
                                       code="internal_error"))

    def end(self) -> bytes:
        """The stream's last bytes, however it ended."""
        return SSE_DONE


def vllm_prompt_logprobs(entries: list[TokenLogprob | None] | None, token_text: TokenText,
                         asked: bool) -> PromptLogprobs | UnsetType:
    """vLLM's `prompt_logprobs` (when `asked` and computed): per prompt token (the first None),
    {token id: {logprob, rank, decoded_token}} of the token itself and its top alternatives."""
    if entries is None or not asked:
        return UNSET
    out: list[dict[str, PromptLogprob] | None] = [None]
    for e in entries[1:]:
        ranked = {t: PromptLogprob(lp, rank, token_text(t))
                  for rank, (t, lp) in enumerate(e.top, start=1)}
        ranked.setdefault(e.token_id, PromptLogprob(e.logprob, e.rank, token_text(e.token_id)))
        out.append({str(t): v for t, v in ranked.items()})
    return out
