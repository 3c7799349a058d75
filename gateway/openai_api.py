"""POST /v1/completions, POST /v1/chat/completions, GET /v1/models, and vLLM's adapter
load/unload routes. Handlers decode (Litestar), translate the body into prompts and
SamplingParams (below), hand them to the Runtime, and return a Struct or an SSE stream.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from litestar import Controller, Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.openapi import ResponseSpec
from litestar.response import Stream

from engine.sampling_params import SamplingParams
from engine.structured import GuidedDecoding, tool_call_schema
from engine.tokenizer import encode_chat
from gateway.auth import require_admin_key, require_api_key
from gateway.errors import APIError
from gateway.formats import ChatFormat, CompletionFormat, Format
from gateway.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    SamplingRequest,
    UnloadLoRAAdapterRequest,
)
from gateway.router import Router
from gateway.runtime import Runtime
from gateway.streaming import GenerationJob, collect, stream_sse

MAX_JSON_BODY_BYTES = 32 * 1024 * 1024  # prompts; adapter uploads go to /admin with their own cap
# Prompts whose text is longer than this are tokenized on a worker thread, not the event loop.
TOKENIZE_INLINE_MAX_CHARS = 16_384
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
OWNER = "lora-gateway"
_ERRORS = {400: "bad parameters, or a prompt longer than the context window",
           401: "missing or wrong key", 404: "unknown model or adapter",
           413: "body too large", 422: "adapter invalid for this base model",
           429: "too many requests in flight; retry after Retry-After seconds",
           503: "the model is still loading"}


def _documented(success: type, streamed: type | None = None) -> dict[int, ResponseSpec]:
    """OpenAPI: the real success body and OpenAI-shaped errors (not Litestar's defaults)."""
    text = f"{success.__name__}" + (f"; with stream=true, text/event-stream of "
                                    f"`data: {streamed.__name__}` events and `data: [DONE]`"
                                    if streamed else "")
    media = "text/plain" if success is str else "application/json"
    responses = {200: ResponseSpec(success, description=text, media_type=media,
                                   generate_examples=False)}
    responses.update({status: ResponseSpec(ErrorResponse, description=why)
                      for status, why in _ERRORS.items()})
    return responses


class OpenAIController(Controller):
    path = "/v1"
    guards = [require_api_key]
    request_max_body_size = MAX_JSON_BODY_BYTES
    tags = ["OpenAI"]

    @post("/completions", status_code=200,
          responses=_documented(CompletionResponse, CompletionResponse))
    async def completions(self, request: Request, data: CompletionRequest,
                          runtime: Runtime, router: Router) -> Response:
        adapter = await _resolve(request, runtime, data.model)
        if (forwarded := await router.route(request, data.model)) is not None:
            return forwarded  # served by a replica that holds the adapter
        if data.echo and data.logprobs is not None:
            raise APIError.bad_request("echo with logprobs is not supported: it needs the "
                                       "prompt's logprobs, which this server does not compute; "
                                       "drop echo or logprobs", param="echo",
                                       code="unsupported_parameter")
        if data.suffix:
            raise APIError.not_supported("suffix", "suffix")
        if data.best_of not in (None, 1, data.n):
            raise APIError.not_supported("best_of other than n", "best_of")
        prompts = await _off_loop_if_large(completion_prompts, data, runtime)
        job = await _start(request, runtime, data, prompts, adapter, data.logprobs, "cmpl")
        fmt = CompletionFormat(job, data.model, runtime.token_text, data.logprobs is not None,
                               echo=prompt_texts(data, prompts, runtime) if data.echo else None)
        return await _respond(request, job, fmt, data)

    @post("/chat/completions", status_code=200,
          responses=_documented(ChatCompletionResponse, ChatCompletionChunk))
    async def chat_completions(self, request: Request, data: ChatCompletionRequest,
                               runtime: Runtime, router: Router) -> Response:
        adapter = await _resolve(request, runtime, data.model)
        if (forwarded := await router.route(request, data.model)) is not None:
            return forwarded  # served by a replica that holds the adapter
        tool_names = _tool_names(data)  # None: no tools in play
        if data.top_logprobs is not None and not data.logprobs:
            raise APIError.bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        prompt = await _off_loop_if_large(chat_prompt, data, runtime)
        logprobs = (data.top_logprobs or 0) if data.logprobs else None
        job = await _start(request, runtime, data, [prompt], adapter, logprobs, "chatcmpl")
        fmt = ChatFormat(job, data.model, runtime.token_text, data.logprobs,
                         tool_names=tool_names)
        return await _respond(request, job, fmt, data)

    @get("/models")
    async def models(self, runtime: Runtime) -> ModelList:
        return ModelList(data=await _model_cards(runtime))

    @get("/models/{model_id:path}")
    async def model(self, model_id: str, runtime: Runtime) -> ModelCard:
        """One entry of /v1/models (the `openai` client's models.retrieve); ids may hold a /."""
        model_id = model_id.lstrip("/")
        for card in await _model_cards(runtime):
            if card.id == model_id:
                return card
        raise APIError.model_not_found(model_id)


async def _model_cards(runtime: Runtime) -> list[ModelCard]:
    runtime.check_ready()
    snapshot = await runtime.snapshot()
    base, limit = runtime.config.model_name, runtime.max_model_len
    cards = [ModelCard(id=base, created=runtime.started_at, owned_by=OWNER,
                       root=str(runtime.config.model), parent=None, residency="device",
                       max_model_len=limit)]
    for record in runtime.resolver.list_models():
        cards.append(ModelCard(id=record.name, created=record.created, owned_by=OWNER,
                               root=record.source, parent=base,
                               residency=runtime.resolver.residency(record.name, snapshot),
                               max_model_len=limit))
    return cards


class AdapterLoadController(Controller):
    """vLLM's runtime adapter routes; unlike vLLM's, unload frees the adapter's memory."""

    path = "/v1"
    guards = [require_admin_key]
    tags = ["Adapters (vLLM-compatible)"]

    @post("/load_lora_adapter", status_code=200, media_type="text/plain",
          responses=_documented(str))
    async def load_lora_adapter(self, data: LoadLoRAAdapterRequest, runtime: Runtime) -> str:
        runtime.check_ready()
        await runtime.resolver.load(data.lora_name, data.lora_path, replace=data.load_inplace)
        return f"Success: LoRA adapter '{data.lora_name}' added successfully."

    @post("/unload_lora_adapter", status_code=200, media_type="text/plain",
          responses=_documented(str))
    async def unload_lora_adapter(self, data: UnloadLoRAAdapterRequest, runtime: Runtime) -> str:
        await runtime.unload_adapter(data.lora_name)
        return f"Success: LoRA adapter '{data.lora_name}' removed successfully."


# ---- translation -----------------------------------------------------------------------------
async def _resolve(request: Request, runtime: Runtime, model: str) -> str | None:
    runtime.check_ready()
    state = request.scope["state"]
    state["model"] = model
    adapter = await runtime.resolver.resolve(model)
    state["adapter"] = adapter or "base"  # the metrics label; set only once resolved
    return adapter


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
        names = _tool_names(data) if isinstance(data, ChatCompletionRequest) else None
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


def _tool_names(data: ChatCompletionRequest) -> list[str] | None:
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


def completion_prompts(data: CompletionRequest, runtime: Runtime) -> list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> one token-id list per prompt."""
    prompt, llm = data.prompt, runtime.llm
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    elif prompt and (all(isinstance(p, str) for p in prompt)
                     or all(isinstance(p, list) for p in prompt)):
        items = list(prompt)
    else:
        raise APIError.bad_request("prompt must be a string, a list of strings, a list of token "
                                   "ids or a list of token-id lists (not empty, not mixed)",
                                   param="prompt")
    try:
        return [llm.tokenize(item) for item in items]
    except ValueError as exc:
        raise APIError.bad_request(str(exc), param="prompt") from None


def prompt_texts(data: CompletionRequest, prompts: list[list[int]],
                 runtime: Runtime) -> list[str]:
    """What echo shows of each prompt: the text sent, or the token ids sent, decoded."""
    if isinstance(data.prompt, str):
        return [data.prompt]
    if all(isinstance(p, str) for p in data.prompt):
        return list(data.prompt)
    tokenizer = runtime.llm.tokenizer
    if tokenizer is None:
        return [""] * len(prompts)  # no text at all without a tokenizer, outputs included
    return [tokenizer.decode(ids, skip_special_tokens=data.skip_special_tokens)
            for ids in prompts]


def chat_prompt(data: ChatCompletionRequest, runtime: Runtime) -> list[int]:
    messages = []
    for m in data.messages:
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise APIError.not_supported("content parts other than text", "messages")
            content = "\n".join(part.text for part in content)
        message = {"role": "system" if m.role == "developer" else m.role,
                   "content": content or ""}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        messages.append(message)
    if runtime.llm.tokenizer is None:
        raise APIError.bad_request("this model has no tokenizer; use /v1/completions with "
                                   "token-id prompts", param="messages")
    try:
        tools = data.tools if data.tool_choice != "none" else None
        return encode_chat(runtime.llm.tokenizer, messages, tools=tools or None)
    except Exception as exc:  # ValueError (no template) or a template that raised
        raise APIError.bad_request(f"the chat template could not render these messages: "
                                   f"{exc}", param="messages") from None


async def _off_loop_if_large(tokenize, data: SamplingRequest, runtime: Runtime):
    """tokenize(data, runtime), on a worker thread when the text is long enough to stall the
    event loop (fast tokenizers encode and decode concurrently without trouble)."""
    if _text_size(data) <= TOKENIZE_INLINE_MAX_CHARS:
        return tokenize(data, runtime)
    return await asyncio.to_thread(tokenize, data, runtime)


def _text_size(data: SamplingRequest) -> int:
    if isinstance(data, ChatCompletionRequest):
        return sum(len(m.content) if isinstance(m.content, str) else
                   sum(len(p.text or "") for p in m.content or []) for m in data.messages)
    prompt = data.prompt
    return len(prompt) if isinstance(prompt, str) else sum(
        len(p) if isinstance(p, str | list) else 1 for p in prompt)


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


async def _start(request: Request, runtime: Runtime, data: SamplingRequest,
                 prompts: list[list[int]], adapter: str | None, logprobs: int | None,
                 kind: str) -> GenerationJob:
    runtime.check_capacity(len(prompts) * data.n)  # before building anything per choice
    limit = runtime.max_model_len
    params, prompt_of = [], []
    for p, ids in enumerate(prompts):
        for j in range(data.n):
            params.append(sampling_params(data, len(ids), limit, logprobs, j))
            prompt_of.append(p)
    arrival = request.scope["state"].get("arrival", time.monotonic())
    return await runtime.start_job(prompts, params, prompt_of, adapter, arrival,
                                   f"{kind}-{uuid.uuid4().hex}")


async def _respond(request: Request, job: GenerationJob, fmt: Format,
                   data: SamplingRequest) -> Response:
    if data.stream:
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        return Stream(stream_sse(job, fmt, include_usage), media_type="text/event-stream",
                      headers=SSE_HEADERS, background=BackgroundTask(job.aclose))
    # a whole response: stop generating if the client goes away before it is ready
    return Response(await collect(job, fmt, asyncio.ensure_future(_disconnect(request))))


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
