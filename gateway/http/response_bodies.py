"""The OpenAI (and vLLM-extension) response bodies, as msgspec Structs: completions and chat
(whole and streamed), models, errors, health; and `sse`, one Server-Sent Event of a body. The
request bodies are in gateway/openai/protocol.py."""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType


class PromptTokensDetails(Struct):
    cached_tokens: int  # prompt tokens served from the prefix cache


class CompletionTokensDetails(Struct):
    reasoning_tokens: int  # of the completion's tokens, those the model thought in


class Usage(Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(Struct):
    """vLLM's Logprob: one token's logprob at one prompt position."""

    logprob: float
    rank: int | None  # among all tokens, 1 = most likely
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    # vLLM's extension, with `prompt_logprobs` asked for: per prompt token (the first None),
    # {token id: Logprob} of the token and its top alternatives (left out otherwise)
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET


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
    # OpenAI requires the key: null in a whole response; a stream chunk's schema allows only
    # an array, so chunks send [] (this server never refuses)
    refusal: list[TokenLogprobOut] | None = None


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
    role: Literal["assistant"] = "assistant"
    refusal: str | None = None  # required by OpenAI's schema; this server never refuses
    # an array or no key at all (OpenAI's schema has no null here)
    tool_calls: list[ToolCall] | msgspec.UnsetType = msgspec.UNSET
    # the model's thinking, apart from its answer: vLLM's name and DeepSeek's (no key without)
    reasoning: str | msgspec.UnsetType = msgspec.UNSET
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET


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
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # vLLM's, as on CompletionChoice


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None
    reasoning: str | None = None  # thinking, as AssistantMessage's (both names)
    reasoning_content: str | None = None


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
    # how it speaks chat (vLLM's parser names; None: its thinking / calls are not parsed)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None


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
