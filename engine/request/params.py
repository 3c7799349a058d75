"""Per-request generation parameters (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from loragw.engine.request.structured import GuidedDecoding


class InvalidParam(ValueError):
    """A request parameter out of range; `param` names it, `code` (if any) is OpenAI's error
    code for it (the gateway's 400 carries both)."""

    def __init__(self, param: str, message: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def _is_token_id(token: object) -> bool:
    return isinstance(token, int) and not isinstance(token, bool) and token >= 0


@dataclass
class SamplingParams:
    """How one request turns logits into tokens. Validated on construction (InvalidParam);
    token ids are checked against the model's vocabulary by `check_token_ids` at admission.

    max_tokens None means the rest of the context window (resolved per sequence at admission).
    temperature 0 means greedy. top_k 0 (or -1) means off. logprobs=N returns the sampled
    token's logprob plus the N most likely alternatives at each step (log-softmax of the raw
    model logits, before logit_bias, penalties and temperature, as vLLM does); prompt_logprobs=N
    the same for every prompt token after the first (the engine's max_logprobs caps both).
    logit_bias (OpenAI): {token id: bias in [-100, 100]} added to the logits before penalties
    and temperature; -100 all but bans a token, +100 all but forces it.
    allowed_token_ids (vLLM): only these tokens may be sampled.
    min_tokens (vLLM): EOS and stop_token_ids are masked, and stop strings are not looked for,
    until that many tokens have been generated.
    include_stop_str_in_output (vLLM): keep the stop string, or the stop token's text, that
    ended the output. skip_special_tokens (vLLM): leave special tokens out of the text.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM: logprobs of the prompt's tokens, N alternatives
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    guided: GuidedDecoding | None = None  # structured output (engine/request/structured.py)
    # An extension: False keeps this request out of speculative decoding (--speculative-config).
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None  # {} means none
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        checks = [
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.temperature >= 0.0, "temperature",
             f"temperature must be non-negative, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, "top_k",
             f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0.0, "repetition_penalty",
             f"repetition_penalty must be positive, got {self.repetition_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs",
             f"logprobs must be at least 0, got {self.logprobs}"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
             f"prompt_logprobs must be at least 0, got {self.prompt_logprobs}"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "stop_token_ids must be non-negative"),
            (0 <= self.min_tokens <= (self.max_tokens or self.min_tokens), "min_tokens",
             f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"),
            (self.min_tokens == 0 or self.guided is None, "min_tokens",
             "min_tokens cannot be combined with structured output (the grammar decides where "
             "the output ends); leave min_tokens out"),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
             "allowed_token_ids", "allowed_token_ids must not be empty (leave it out to allow "
             "every token)"),
            (self.allowed_token_ids is None or self.guided is None, "allowed_token_ids",
             "allowed_token_ids cannot be combined with structured output (the grammar "
             "already decides which tokens may come); leave allowed_token_ids out"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidParam(param, message)
        for token, bias in (self.logit_bias or {}).items():
            if not _is_token_id(token):
                raise InvalidParam("logit_bias", f"logit_bias key {token!r} is not a token id "
                                   "(a non-negative integer)")
            if not -100.0 <= bias <= 100.0:
                raise InvalidParam("logit_bias", f"logit_bias[{token}] must be in [-100, 100], "
                                   f"got {bias}")
        if self.allowed_token_ids is not None and not all(
                _is_token_id(t) for t in self.allowed_token_ids):
            raise InvalidParam("allowed_token_ids",
                               "allowed_token_ids must be non-negative integers")
        # What the sampler asks of every row of every step, decided once: nothing changes a
        # request's params after this (the engine's own changes go through dataclasses.replace).
        self.greedy = self.temperature == 0.0 or self.top_k == 1
        self.penalized = (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                          or self.presence_penalty != 0.0)
        # allowed_token_ids or logit_bias, or EOS and stop tokens masked until min_tokens
        self.edits_logits = (self.allowed_token_ids is not None or self.logit_bias is not None
                             or self.min_tokens > 0)
        # greedy with nothing to edit or report: a batch of such rows is one argmax
        self.plain = (self.greedy and not self.penalized and not self.edits_logits
                      and self.logprobs is None)
        # its next step may be scheduled before its token is read (--async-scheduling): the
        # sampler reads none of its earlier tokens' values, nor the host anything it reports
        self.pipelines = (not self.penalized and self.logprobs is None and self.guided is None
                          and self.prompt_logprobs is None)

    def check_token_ids(self, vocab_size: int) -> None:
        """InvalidParam naming the first logit_bias key or allowed token id that is not a token
        of a vocabulary of `vocab_size` tokens."""
        for param, ids in (("logit_bias", self.logit_bias or ()),
                           ("allowed_token_ids", self.allowed_token_ids or ())):
            for token in ids:
                if token >= vocab_size:
                    what = f"key {token}" if param == "logit_bias" else f"token id {token}"
                    raise InvalidParam(param, f"{param} {what} is not a token of this model "
                                       f"(token ids are 0 to {vocab_size - 1})")


def with_max_tokens(params: SamplingParams, prompt_len: int, max_model_len: int) -> SamplingParams:
    """`params` with max_tokens decided, once per request: as asked, else the rest of the context
    window after a prompt of `prompt_len` tokens (the server decides it at admission and the
    request carries it; the engine decides it for the offline API)."""
    if params.max_tokens is not None:
        return params
    return replace(params, max_tokens=max_model_len - prompt_len)
