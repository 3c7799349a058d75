"""The engine's admission rules for one request, each with its one message (InvalidParam names
the parameter, and carries OpenAI's error code where there is one): a prompt of token ids in
the vocabulary, the context window, the KV cache, logprobs within --max-logprobs, token ids of
logit_bias / allowed_token_ids in the vocabulary, min_tokens that can be met."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.config import Config
from engine.sampling_params import InvalidParam, SamplingParams


def check_request(config: Config, vocab_size: int, blocks: BlockManager,
                  eos_token_ids: set[int], prompt_ids: list[int],
                  params: SamplingParams) -> None:
    vocab, limit = vocab_size, config.max_model_len
    if not prompt_ids:
        raise InvalidParam("prompt", "prompt is empty")
    if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_ids):
        raise InvalidParam("prompt", f"prompt token ids must be integers in [0, {vocab})")
    prompt_len, asked = len(prompt_ids), params.max_tokens
    if prompt_len + (asked or 1) > limit:
        plus = "" if asked is None else f" plus {asked} in max_tokens"
        raise InvalidParam(
            "prompt" if asked is None else "max_tokens",
            f"This model's maximum context length is {limit} tokens, but the request has "
            f"{prompt_len} prompt tokens{plus}; shorten the prompt or lower max_tokens",
            code="context_length_exceeded")
    max_tokens = asked or limit - prompt_len
    needed = blocks.peak_blocks(prompt_len + max_tokens)  # fewer than all under a window
    if needed > blocks.num_blocks:
        raise InvalidParam("max_tokens", f"request needs {needed} KV blocks for its prompt "
                           f"and max_tokens but the cache holds "
                           f"{blocks.num_blocks}; lower max_tokens or give the "
                           "engine more KV blocks")
    if params.min_tokens > max_tokens:
        raise InvalidParam("min_tokens", f"min_tokens must be in [0, max_tokens="
                           f"{max_tokens}], got {params.min_tokens}")
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, name)
        if asked is not None and asked > config.max_logprobs:
            raise InvalidParam(name, f"{name} asks for {asked} alternatives per token; this "
                               f"server returns at most {config.max_logprobs} "
                               "(--max-logprobs)")
    params.check_token_ids(vocab)
    if params.allowed_token_ids is not None and params.min_tokens > 0:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos
                                              else eos_token_ids)
        if stops.issuperset(params.allowed_token_ids):
            raise InvalidParam("allowed_token_ids", "every token in allowed_token_ids ends "
                               "the output, so min_tokens can never be met; allow other "
                               "tokens or leave min_tokens out")
