"""OpenAI request bodies -> the engine's SamplingParams: defaults, stop strings, logit_bias,
tools, and the one structured-output constraint (GuidedDecoding), each built once per
request; then one SamplingParams per choice (`choice_params`). Every refusal is a 400 that
names the parameter. What needs the model (the context window, token ids against the
vocabulary) the engine checks, once, when the request is queued (LLMEngine.check_request)."""

from __future__ import annotations

from dataclasses import replace

import msgspec

from loragw.adapters.errors import short_name
from loragw.engine.api import GenerationDefaults, GuidedDecoding, InvalidParam, SamplingParams
from loragw.gateway.common.errors import APIError
from loragw.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from loragw.gateway.openai.tool_calls import tool_call_schema

MAX_TOKEN_ID_DIGITS = 18  # a logit_bias key longer than this is no token id (nor an int64)


def check_completion_options(data: CompletionRequest) -> None:
    """Refuse the /v1/completions options this server does not implement, or that cannot go
    together."""
    if data.max_tokens == 0 and not data.echo:
        raise APIError.bad_request("max_tokens 0 returns nothing without echo; ask for at "
                                   "least 1 token, or echo the prompt (with logprobs: its "
                                   "tokens' logprobs)", param="max_tokens")
    if data.suffix:
        raise APIError.not_supported("suffix", "suffix")
    if data.best_of not in (None, 1, data.n):
        raise APIError.not_supported("best_of other than n", "best_of")


def check_prompt_logprobs(data: SamplingRequest) -> None:
    """vLLM's prompt_logprobs are one prompt's, so one choice's: not with n or best_of."""
    if data.prompt_logprobs is None:
        return
    best_of = getattr(data, "best_of", None) or 1
    if data.n > 1 or best_of > 1:
        raise APIError.bad_request("prompt_logprobs are given for one choice; ask with n=1 (and "
                                   "no best_of)", param="prompt_logprobs")


def completion_prompt_logprobs(data: CompletionRequest) -> int | None:
    """The prompt logprobs a completion needs: vLLM's prompt_logprobs, and echo with logprobs
    (the legacy API's prompt logprobs), whichever asks for more alternatives."""
    asked = [n for n in (data.prompt_logprobs, data.logprobs if data.echo else None)
             if n is not None]
    return max(asked) if asked else None


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
            raise APIError.bad_request(f"tool_choice names {short_name(str(name))}, which is "
                                       f"not in tools ({short_name(', '.join(names))})",
                                       param="tool_choice")
        return [name]
    raise APIError.bad_request("tool_choice must be none, auto, required or "
                               "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                               param="tool_choice")


def guided_decoding(data: SamplingRequest, names: list[str] | None,
                    forced: GuidedDecoding | None = None) -> GuidedDecoding | None:
    """The one structured-output constraint a request asks for (response_format, vLLM's
    guided_*, or a forced tool call of one of `names`, the request's `tool_names`: `forced`,
    in the served model's own call syntax, else the generic JSON object), or None."""
    asked: list[tuple[str, GuidedDecoding]] = []
    fmt = data.response_format
    param = "response_format"
    try:  # `param`: the field being read, which a refusal names
        if fmt is not None and fmt.type == "json_object":
            asked.append((param, GuidedDecoding("json_object")))
        elif fmt is not None and fmt.type == "json_schema":
            schema = (fmt.json_schema or {}).get("schema")
            if schema is None:
                raise ValueError("response_format json_schema needs json_schema.schema")
            asked.append((param, GuidedDecoding("json_schema", schema)))
        elif fmt is not None and fmt.type != "text":
            raise ValueError(f"response_format type must be text, json_object or json_schema, "
                             f"got {fmt.type!r}")
        for param, kind, spec in (("guided_json", "json_schema", data.guided_json),
                                  ("guided_regex", "regex", data.guided_regex),
                                  ("guided_choice", "choice", data.guided_choice)):
            if spec is not None:
                asked.append((param, GuidedDecoding(kind, spec)))
        if names is not None and data.tool_choice not in (None, "auto"):
            param = "tool_choice"
            asked.append((param, forced or GuidedDecoding("json_schema",
                                                          tool_call_schema(data.tools, names))))
    except ValueError as exc:
        raise APIError.bad_request(str(exc), param=param) from None
    if len(asked) > 1:
        raise APIError.bad_request(f"only one structured-output constraint per request, got "
                                   f"{', '.join(name for name, _ in asked)}",
                                   param=asked[1][0])
    if not asked:
        return None
    param, guided = asked[0]
    try:  # what the engine process gets as msgpack, whose integers are 64-bit
        msgspec.msgpack.encode(guided.spec)
    except OverflowError:
        raise APIError.bad_request(f"{param}: the schema holds an integer outside the 64-bit "
                                   "range", param=param) from None
    return guided


def sampling_params(data: SamplingRequest, logprobs: int | None,
                    guided: GuidedDecoding | None = None,
                    prompt_logprobs: int | None = None,
                    defaults: GenerationDefaults | None = None) -> SamplingParams:
    """The engine parameters of a request's first choice (choice_params makes the others).
    What the request leaves out is the served model's `defaults` (its generation_config.json),
    else OpenAI's; max_tokens left out there too is None: the rest of the context window,
    decided at admission; 0 (echo only) is 1, whose token the format leaves out."""
    stop = [data.stop] if isinstance(data.stop, str) else list(data.stop or [])
    asked = (defaults or GenerationDefaults()).filled({
        "temperature": data.temperature, "top_p": data.top_p, "top_k": data.top_k,
        "min_p": data.min_p, "repetition_penalty": data.repetition_penalty,
        "max_tokens": getattr(data, "max_completion_tokens", None) or data.max_tokens})
    try:
        return SamplingParams(
            max_tokens=asked["max_tokens"] if data.max_tokens != 0 else 1,
            temperature=1.0 if asked["temperature"] is None else asked["temperature"],
            # top_p 0 (OpenAI's range includes it): only the most likely token, i.e. top_k 1
            top_p=asked["top_p"] or 1.0,
            top_k=1 if asked["top_p"] == 0 else asked["top_k"] or 0,
            min_p=asked["min_p"] or 0.0, seed=data.seed,
            repetition_penalty=asked["repetition_penalty"] or 1.0,
            frequency_penalty=data.frequency_penalty or 0.0,
            presence_penalty=data.presence_penalty or 0.0, stop=stop,
            stop_token_ids=list(data.stop_token_ids or []), ignore_eos=data.ignore_eos,
            min_tokens=data.min_tokens, logit_bias=logit_bias(data.logit_bias),
            allowed_token_ids=data.allowed_token_ids,
            include_stop_str_in_output=data.include_stop_str_in_output,
            skip_special_tokens=data.skip_special_tokens, logprobs=logprobs, guided=guided,
            prompt_logprobs=prompt_logprobs, speculative=getattr(data, "speculative", True))
    except InvalidParam as exc:
        raise APIError.from_engine(exc) from None


def choice_params(first: SamplingParams, num_prompts: int,
                  n: int) -> tuple[list[SamplingParams], list[int]]:
    """The n choices of every prompt: each one's SamplingParams, and the prompt it answers.
    Choice j of a prompt runs with seed + j, so the n choices differ yet stay reproducible."""
    per_choice = [first if first.seed is None or j == 0 else replace(first, seed=first.seed + j)
                  for j in range(n)]
    return per_choice * num_prompts, [p for p in range(num_prompts) for _ in range(n)]


def logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} -> {token id: bias}; a 400 names a key that is not one.
    (Token ids past the vocabulary are refused at admission, where the vocabulary is known.)"""
    bias = {}
    for key, value in (raw or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS):
            raise APIError.bad_request(f"logit_bias key {key!r} is not a token id; keys are "
                                       "token ids written as strings, e.g. {\"1234\": -100}",
                                       param="logit_bias")
        bias[int(key)] = value
    return bias or None
