"""OpenAI request bodies -> the engine's SamplingParams: defaults, the context-length check,
stop strings, logit_bias, tools, and the one structured-output constraint (GuidedDecoding).
Every refusal is a 400 that names the parameter."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from engine.structured import GuidedDecoding, tool_call_schema
from gateway.errors import APIError
from gateway.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest


def check_completion_options(data: CompletionRequest) -> None:
    """Refuse the /v1/completions options this server does not implement."""
    if data.echo and data.logprobs is not None:
        raise APIError.bad_request("echo with logprobs is not supported: it needs the "
                                   "prompt's logprobs, which this server does not compute; "
                                   "drop echo or logprobs", param="echo",
                                   code="unsupported_parameter")
    if data.suffix:
        raise APIError.not_supported("suffix", "suffix")
    if data.best_of not in (None, 1, data.n):
        raise APIError.not_supported("best_of other than n", "best_of")


def chat_logprobs(data: ChatCompletionRequest) -> int | None:
    """logprobs + top_logprobs -> how many top alternatives per token (None: no logprobs)."""
    if data.top_logprobs is not None and not data.logprobs:
        raise APIError.bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    return (data.top_logprobs or 0) if data.logprobs else None


def tool_names(data: ChatCompletionRequest) -> list[str] | None:
    """The tools the output may call (all of them, or the named one); None when none may."""
    if not data.tools and data.tool_choice not in (None, "none", "auto"):
        raise APIError.bad_request("tool_choice needs tools", param="tool_choice")
    if not data.tools or data.tool_choice == "none":
        return None
    names = []
    for tool in data.tools:
        function = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError.bad_request("each tool must be {\"type\": \"function\", \"function\": "
                                       "{\"name\": ..., \"parameters\": {...}}}", param="tools")
        names.append(function["name"])
    choice = data.tool_choice
    if choice in (None, "auto", "required"):
        return names
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise APIError.bad_request(f"tool_choice names {name!r}, which is not in tools "
                                       f"({', '.join(names)})", param="tool_choice")
        return [name]
    raise APIError.bad_request("tool_choice must be none, auto, required or "
                               "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                               param="tool_choice")


def guided_decoding(data: SamplingRequest) -> GuidedDecoding | None:
    """The one structured-output constraint a request asks for (response_format, vLLM's
    guided_*, or a forced tool call), or None."""
    asked: list[tuple[str, GuidedDecoding]] = []
    fmt = data.response_format
    try:
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", GuidedDecoding("json_object")))
        elif fmt is not None and fmt.type == "json_schema":
            schema = (fmt.json_schema or {}).get("schema")
            if schema is None:
                raise ValueError("response_format json_schema needs json_schema.schema")
            asked.append(("response_format", GuidedDecoding("json_schema", schema)))
        elif fmt is not None and fmt.type != "text":
            raise ValueError(f"response_format type must be text, json_object or json_schema, "
                             f"got {fmt.type!r}")
        if data.guided_json is not None:
            asked.append(("guided_json", GuidedDecoding("json_schema", data.guided_json)))
        if data.guided_regex is not None:
            asked.append(("guided_regex", GuidedDecoding("regex", data.guided_regex)))
        if data.guided_choice is not None:
            asked.append(("guided_choice", GuidedDecoding("choice", data.guided_choice)))
        names = tool_names(data) if isinstance(data, ChatCompletionRequest) else None
        if names is not None and data.tool_choice not in (None, "auto"):
            asked.append(("tool_choice",
                          GuidedDecoding("json_schema", tool_call_schema(data.tools, names))))
    except ValueError as exc:
        raise APIError.bad_request(str(exc), param="response_format") from None
    if len(asked) > 1:
        raise APIError.bad_request(f"only one structured-output constraint per request, got "
                                   f"{', '.join(name for name, _ in asked)}",
                                   param=asked[1][0])
    return asked[0][1] if asked else None


def choice_params(data: SamplingRequest, prompts: list[list[int]], limit: int,
                  logprobs: int | None) -> tuple[list[SamplingParams], list[int]]:
    """The n choices of every prompt: each one's SamplingParams, and the prompt it answers."""
    params, prompt_of = [], []
    for p, ids in enumerate(prompts):
        for j in range(data.n):
            params.append(sampling_params(data, len(ids), limit, logprobs, j))
            prompt_of.append(p)
    return params, prompt_of


def sampling_params(data: SamplingRequest, prompt_len: int, limit: int, logprobs: int | None,
                    offset: int) -> SamplingParams:
    """The engine parameters of one choice; `offset` (its index within n) shifts the seed so
    the n choices differ yet stay reproducible."""
    requested = getattr(data, "max_completion_tokens", None) or data.max_tokens
    if prompt_len + (requested or 1) > limit:
        asked = "" if requested is None else f" plus {requested} in max_tokens"
        raise APIError.bad_request(
            f"This model's maximum context length is {limit} tokens, but the request has "
            f"{prompt_len} prompt tokens{asked}; shorten the prompt or lower max_tokens",
            param="max_tokens" if requested else "prompt", code="context_length_exceeded")
    stop = [data.stop] if isinstance(data.stop, str) else list(data.stop or [])
    guided = guided_decoding(data)
    try:
        return SamplingParams(
            max_tokens=requested or limit - prompt_len,
            temperature=1.0 if data.temperature is None else data.temperature,
            top_p=1.0 if data.top_p is None else data.top_p,
            top_k=data.top_k or 0, min_p=data.min_p or 0.0,
            seed=None if data.seed is None else data.seed + offset,
            repetition_penalty=data.repetition_penalty or 1.0,
            frequency_penalty=data.frequency_penalty or 0.0,
            presence_penalty=data.presence_penalty or 0.0, stop=stop,
            stop_token_ids=list(data.stop_token_ids or []), ignore_eos=data.ignore_eos,
            min_tokens=data.min_tokens, logit_bias=logit_bias(data.logit_bias),
            allowed_token_ids=data.allowed_token_ids,
            include_stop_str_in_output=data.include_stop_str_in_output,
            skip_special_tokens=data.skip_special_tokens, logprobs=logprobs, guided=guided)
    except ValueError as exc:  # InvalidParam names the parameter
        raise APIError.bad_request(str(exc), param=getattr(exc, "param", None)) from None


def logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} -> {token id: bias}; a 400 names a key that is not one.
    (Token ids past the vocabulary are refused at admission, where the vocabulary is known.)"""
    bias = {}
    for key, value in (raw or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise APIError.bad_request(f"logit_bias key {key!r} is not a token id; keys are "
                                       "token ids written as strings, e.g. {\"1234\": -100}",
                                       param="logit_bias")
        bias[int(key)] = value
    return bias or None
