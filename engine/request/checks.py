"""The admission rules for one request, each with its one message (InvalidParam names the
parameter, and carries OpenAI's error code where there is one): a prompt of token ids in the
vocabulary, the context window, the KV cache, logprobs within --max-logprobs, token ids of
logit_bias / allowed_token_ids in the vocabulary and no more of them than it has, stop strings
within their caps, min_tokens that can be met.

They need only `RequestLimits`, what an engine knows of itself and never changes: the engine
checks every request against its own (LLMEngine.add_requests), and a server checks against the
copy its EngineInfo carries before anything is sent to the engine (gateway/openai/admission.py),
so a request that would be refused never crosses the channel, and both say the same thing.
The cheap rules run first: a 500,000-token prompt is refused by its length, not by a scan.
"""

from __future__ import annotations

from dataclasses import dataclass

from loragw.engine.request.params import InvalidParam, SamplingParams

# Stop strings are matched against the text after every token: their count and length bound
# that work (OpenAI allows 4; vLLM sets no cap; these leave room for either's users).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096


def peak_blocks(num_tokens: int, block_size: int, window: int | None,
                max_chunk: int | None) -> int:
    """The most blocks a sequence of num_tokens tokens holds at once: all of them, or under a
    window the window's (window - 1 keys before a chunk) plus one chunk's, + 1 for the
    alignment of their ends to blocks."""
    held = -(-num_tokens // block_size)
    if window is None or max_chunk is None:
        return held
    return min(held, -(-(window - 1 + max_chunk) // block_size) + 1)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    max_logprobs: int
    eos_token_ids: frozenset[int]
    num_blocks: int  # KV-cache blocks
    block_size: int
    window: int | None = None  # every layer's sliding window (None: some layer sees all)
    max_chunk: int | None = None  # most tokens one step computes for one sequence

    def peak_blocks(self, num_tokens: int) -> int:
        return peak_blocks(num_tokens, self.block_size, self.window, self.max_chunk)


def check_request(limits: RequestLimits, prompt_ids: list[int], params: SamplingParams) -> None:
    vocab, limit = limits.vocab_size, limits.max_model_len
    if not prompt_ids:
        raise InvalidParam("prompt", "prompt is empty")
    prompt_len, asked = len(prompt_ids), params.max_tokens
    if prompt_len + (asked or 1) > limit:
        plus = "" if asked is None else f" plus {asked} in max_tokens"
        raise InvalidParam(
            "prompt" if asked is None else "max_tokens",
            f"This model's maximum context length is {limit} tokens, but the request has "
            f"{prompt_len} prompt tokens{plus}; shorten the prompt or lower max_tokens",
            code="context_length_exceeded")
    if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_ids):
        raise InvalidParam("prompt", f"prompt token ids must be integers in [0, {vocab})")
    max_tokens = asked or limit - prompt_len
    needed = limits.peak_blocks(prompt_len + max_tokens)  # fewer than all under a window
    if needed > limits.num_blocks:
        raise InvalidParam("max_tokens", f"request needs {needed} KV blocks for its prompt "
                           f"and max_tokens but the cache holds "
                           f"{limits.num_blocks}; lower max_tokens or give the "
                           "engine more KV blocks")
    if params.min_tokens > max_tokens:
        raise InvalidParam("min_tokens", f"min_tokens must be in [0, max_tokens="
                           f"{max_tokens}], got {params.min_tokens}")
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, name)
        if asked is not None and asked > limits.max_logprobs:
            raise InvalidParam(name, f"{name} asks for {asked} alternatives per token; this "
                               f"server returns at most {limits.max_logprobs} "
                               "(--max-logprobs)")
    check_sizes(params, vocab)
    params.check_token_ids(vocab)
    if params.allowed_token_ids is not None and params.min_tokens > 0:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos
                                              else limits.eos_token_ids)
        if stops.issuperset(params.allowed_token_ids):
            raise InvalidParam("allowed_token_ids", "every token in allowed_token_ids ends "
                               "the output, so min_tokens can never be met; allow other "
                               "tokens or leave min_tokens out")


def check_sizes(params: SamplingParams, vocab: int) -> None:
    """Lists of token ids no longer than the vocabulary (each id once is all they can say),
    stop strings within their caps."""
    for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
        count = len(getattr(params, name) or ())
        if count > vocab:
            raise InvalidParam(name, f"{name} has {count} entries but this model has {vocab} "
                               "tokens; name each token id at most once")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidParam("stop", f"stop has {len(params.stop)} strings; at most "
                           f"{MAX_STOP_STRINGS} are accepted")
    longest = max(map(len, params.stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise InvalidParam("stop", f"a stop string has {longest} characters; at most "
                           f"{MAX_STOP_CHARS} are accepted")
