"""POST /v1/completions, POST /v1/chat/completions, GET /v1/models, and vLLM's adapter
load/unload routes. Handlers decode (Litestar), translate the body into prompts
(gateway/prompts.py) and SamplingParams (gateway/request_params.py), hand them to the Runtime,
and return a Struct or an SSE stream.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from litestar import Controller, Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.openapi import ResponseSpec
from litestar.response import Stream

from gateway.auth import require_admin_key, require_api_key
from gateway.errors import APIError
from gateway.formats import ChatFormat, CompletionFormat, Format
from gateway.prompts import chat_prompt, completion_prompts, off_loop_if_large, prompt_texts
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
from gateway.request_params import (
    chat_logprobs,
    check_completion_options,
    choice_params,
    tool_names,
)
from gateway.router import Router
from gateway.runtime import Runtime
from gateway.streaming import GenerationJob, collect, stream_sse

MAX_JSON_BODY_BYTES = 32 * 1024 * 1024  # prompts; adapter uploads go to /admin with their own cap
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
        adapter, forwarded = await _resolve_or_forward(request, runtime, router, data.model)
        if forwarded is not None:
            return forwarded
        check_completion_options(data)
        prompts = await off_loop_if_large(completion_prompts, data, runtime)
        job = await _start(request, runtime, data, prompts, adapter, data.logprobs, "cmpl")
        fmt = CompletionFormat(job, data.model, runtime.token_text, data.logprobs is not None,
                               echo=prompt_texts(data, prompts, runtime) if data.echo else None)
        return await _respond(request, job, fmt, data)

    @post("/chat/completions", status_code=200,
          responses=_documented(ChatCompletionResponse, ChatCompletionChunk))
    async def chat_completions(self, request: Request, data: ChatCompletionRequest,
                               runtime: Runtime, router: Router) -> Response:
        adapter, forwarded = await _resolve_or_forward(request, runtime, router, data.model)
        if forwarded is not None:
            return forwarded
        names = tool_names(data)  # None: no tools in play
        logprobs = chat_logprobs(data)
        prompt = await off_loop_if_large(chat_prompt, data, runtime)
        job = await _start(request, runtime, data, [prompt], adapter, logprobs, "chatcmpl")
        fmt = ChatFormat(job, data.model, runtime.token_text, data.logprobs, tool_names=names)
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


# ---- one generation request, start to finish -------------------------------------------------
async def _resolve_or_forward(request: Request, runtime: Runtime, router: Router,
                              model: str) -> tuple[str | None, Response | None]:
    """The adapter to serve `model` with (None: the base), made ready here; and the response
    of a replica that holds it, when the router forwards the request there instead."""
    runtime.check_ready()
    state = request.scope["state"]
    state["model"] = model
    adapter = await runtime.resolver.resolve(model)
    state["adapter"] = adapter or "base"  # the metrics label; set only once resolved
    return adapter, await router.route(request, model)


async def _start(request: Request, runtime: Runtime, data: SamplingRequest,
                 prompts: list[list[int]], adapter: str | None, logprobs: int | None,
                 kind: str) -> GenerationJob:
    runtime.check_capacity(len(prompts) * data.n)  # before building anything per choice
    params, prompt_of = choice_params(data, prompts, runtime.max_model_len, logprobs)
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
