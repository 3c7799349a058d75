"""The OpenAI (and vLLM-extension) request and response bodies, as msgspec Structs.

Requests keep unknown fields out of the way (ignored), so clients that send newer OpenAI fields
still work; fields we accept but do not implement yet are refused by the handlers with a 400.
Ranges live in the types (`Meta`), so the OpenAPI schema states them and decoding enforces them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

MAX_N = 128  # choices per request, as OpenAI
MAX_LOGPROBS = 20

PositiveInt = Annotated[int, Meta(ge=1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1 - MAX_N)]  # seed + i stays an int64
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Meta(ge=0)]


# ---- requests ------------------------------------------------------------------------------
class StreamOptions(Struct):
    include_usage: bool = False


class ResponseFormat(Struct):
    type: str
    json_schema: dict[str, Any] | None = None


class SamplingRequest(Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: PositiveInt | None = None  # default: the rest of the context window
    temperature: Annotated[float, Meta(ge=0.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # {"token id": bias in [-100, 100]}, added to the logits; checked by SamplingParams, whose
    # 400 names the key (a Meta range here could only say `logit_bias[...]`)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # vLLM extensions, from here to allowed_token_ids
    stop_token_ids: list[TokenId] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0  # no EOS, stop token or stop string before
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: Annotated[list[TokenId], Meta(min_length=1)] | None = None
    response_format: ResponseFormat | None = None  # text, json_object, json_schema
    guided_json: dict[str, Any] | str | None = None  # vLLM extensions: structured output
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    user: str | None = None  # accepted, ignored


class CompletionRequest(SamplingRequest, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]; msgspec allows one array type per union,
    # so list items are a union and the handler checks the list is homogeneous.
    prompt: str | list[str | TokenId | list[TokenId]]
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False  # prepend the prompt's text to each choice's (not with logprobs)
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


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None  # [{"type": "function", "function": {...}}]
    tool_choice: str | dict[str, Any] | None = None  # none, auto, required, or a named function
    parallel_tool_calls: bool | None = None


class LoadLoRAAdapterRequest(Struct):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM: replace an adapter already loaded under this name


class UnloadLoRAAdapterRequest(Struct):
    lora_name: str
    lora_int_id: int | None = None  # vLLM sends it; ignored


# ---- responses -----------------------------------------------------------------------------
class PromptTokensDetails(Struct):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    object: str = "text_completion"


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[TokenLogprobOut]


class FunctionCall(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None  # a JSON object, as a string


class ToolCall(Struct, omit_defaults=True):
    id: str
    type: str  # "function"
    function: FunctionCall


class ToolCallChunk(Struct, omit_defaults=True):
    """A stream delta's piece of call `index`: the first has id, type and the name, the rest
    only argument text (clients concatenate them)."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCall | None = None


class AssistantMessage(Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCall] | None = None


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str
    root: str
    parent: str | None
    # extensions: where the weights are on this replica now ("remote": in the fleet's
    # catalog, fetched on first use), and for adapters their catalog version, sha256 and the
    # replicas that hold them in a device slot
    residency: Literal["device", "host", "disk", "remote"]
    max_model_len: int
    object: str = "model"
    version: int | None = None
    sha256: str | None = None
    resident_on: list[str] | None = None


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorBody(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorBody


class Health(Struct, omit_defaults=True):
    status: str
    detail: str | None = None


_encoder = msgspec.json.Encoder()


def sse(payload: Struct) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
