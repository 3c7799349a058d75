"""The OpenAI (and vLLM-extension) request bodies, as msgspec Structs (the response bodies:
gateway/http/response_bodies.py).

Requests keep unknown fields out of the way (ignored), so clients that send newer OpenAI fields
still work; fields we accept but do not implement yet are refused by the handlers with a 400.
Ranges live in the types (`Meta`), so the OpenAPI schema states them and decoding enforces them
(`bounds`: restated for the document); `openapi` documents what a handler or the engine checks
(with a message naming the key) where a type cannot (gateway/http/openapi_docs.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from loragw.gateway.http.openapi_docs import TOKEN_ID, bounds, openapi

MAX_N = 128  # choices per request, as OpenAI
MAX_LOGPROBS = 20
INT64_MAX = 2**63 - 1  # the engine process gets requests as msgpack: 64-bit integers

PositiveInt = Annotated[int, Meta(ge=1, le=INT64_MAX)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1 - MAX_N)]  # seed + i stays an int64
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Meta(ge=0, le=INT64_MAX)]  # the engine checks the vocabulary
TokenIds = Annotated[list[TokenId], Meta(extra_json_schema=openapi(items=TOKEN_ID))]
# Alternatives per token: at most the server's --max-logprobs (MAX_LOGPROBS by default), which
# the engine checks (its 400 names the parameter); documented at the default.
Logprobs = Annotated[int, Meta(ge=0, extra_json_schema=openapi(minimum=0, maximum=MAX_LOGPROBS))]
_PROMPT = openapi(one_of=[
    {"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}},
    {"type": "array", "minItems": 1, "items": TOKEN_ID},
    {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1,
                                                "items": TOKEN_ID}}])
_LOGIT_BIAS = openapi(property_names={"pattern": "^[0-9]{1,18}$"},
                      additional_properties={"type": "number", "minimum": -100, "maximum": 100})


# ---- requests ------------------------------------------------------------------------------
class StreamOptions(Struct):
    include_usage: bool = False


class ResponseFormat(Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingRequest(Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: PositiveInt | None = None  # default: the rest of the context window
    temperature: Annotated[float, bounds(ge=0.0)] | None = None
    # 0 (as OpenAI allows): only the most likely token, i.e. top_k=1 (request_params)
    top_p: Annotated[float, bounds(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, bounds(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[float, bounds(ge=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, bounds(gt=0.0)] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # {"token id": bias in [-100, 100]}, added to the logits; checked by SamplingParams, whose
    # 400 names the key (a Meta range here could only say `logit_bias[...]`)
    logit_bias: Annotated[dict[str, float], Meta(extra_json_schema=_LOGIT_BIAS)] | None = None
    ignore_eos: bool = False  # vLLM extensions, from here to allowed_token_ids
    stop_token_ids: TokenIds | None = None
    # no EOS, stop token or stop string before; at most max_tokens (SamplingParams)
    min_tokens: Annotated[int, bounds(ge=0, le=INT64_MAX)] = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: Annotated[list[TokenId], Meta(
        min_length=1, extra_json_schema=openapi(items=TOKEN_ID))] | None = None
    response_format: ResponseFormat | None = None  # text, json_object, json_schema
    guided_json: dict[str, Any] | str | None = None  # vLLM extensions: structured output
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Meta(extra_json_schema=openapi(
        min_items=1, items={"type": "string", "minLength": 1}))] | None = None
    # vLLM's: the prompt tokens' logprobs with this many alternatives (the response's
    # `prompt_logprobs`); not with n > 1
    prompt_logprobs: Logprobs | None = None
    # an extension: false keeps this request out of speculative decoding (--speculative-config)
    speculative: bool = True
    user: str | None = None  # keeps one alias target per user (adapters/aliases.py)


class CompletionRequest(SamplingRequest, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]; msgspec allows one array type per union,
    # so list items are a union and the handler checks the list is homogeneous.
    prompt: Annotated[str | list[str | TokenId | list[TokenId]], Meta(extra_json_schema=_PROMPT)]
    # 0 only with echo: the prompt's text (and with logprobs its tokens' logprobs), no output
    max_tokens: Annotated[int, bounds(ge=0, le=INT64_MAX)] | None = None
    logprobs: Logprobs | None = None
    echo: bool = False  # prepend the prompt's text (with logprobs: and its tokens' logprobs)
    suffix: str | None = None  # not supported
    best_of: int | None = None  # only None or n


class TextPart(Struct):
    type: str
    text: str | None = None


class ChatMessage(Struct, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # an earlier assistant turn's thinking (vLLM's name, DeepSeek's): for templates that use it
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    tools: list[dict[str, Any]] | None = None  # [{"type": "function", "function": {...}}]
    tool_choice: str | dict[str, Any] | None = None  # none, auto, required, or a named function
    parallel_tool_calls: bool | None = None
    # vLLM's: kwargs the chat template renders with (over --default-chat-template-kwargs, e.g.
    # {"enable_thinking": false}), whether it adds the assistant's generation prompt, or
    # continues the last (assistant) message instead
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # its own template (--trust-request-chat-template)


class LoadLoRAAdapterRequest(Struct):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM: replace an adapter already loaded under this name


class UnloadLoRAAdapterRequest(Struct):
    lora_name: str
    lora_int_id: int | None = None  # vLLM sends it; ignored
