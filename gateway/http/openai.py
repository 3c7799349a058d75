"""POST /v1/completions, POST /v1/chat/completions, GET /v1/models, and vLLM's adapter
load/unload routes. Handlers decode (Litestar) and hand the body to admission
(gateway/http/admission.py), which returns a Struct or an SSE stream.
"""

from __future__ import annotations

from litestar import Controller, Request, Response, get, post
from litestar.openapi import ResponseSpec

from gateway.errors import APIError
from gateway.http.admission import serve_chat, serve_completion
from gateway.http.auth import require_admin_key, require_api_key
from gateway.http.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from gateway.runtime import Runtime

MAX_JSON_BODY_BYTES = 32 * 1024 * 1024  # prompts; adapter uploads go to /admin with their own cap
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
                          runtime: Runtime) -> Response:
        return await serve_completion(request, data, runtime)

    @post("/chat/completions", status_code=200,
          responses=_documented(ChatCompletionResponse, ChatCompletionChunk))
    async def chat_completions(self, request: Request, data: ChatCompletionRequest,
                               runtime: Runtime) -> Response:
        return await serve_chat(request, data, runtime)

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
    base, limit = runtime.config.model_name, runtime.info.max_model_len
    cards = [ModelCard(id=base, created=runtime.started_at, owned_by=OWNER,
                       root=str(runtime.config.model), parent=None, residency="device",
                       max_model_len=limit)]
    where = await runtime.adapters.resident_on()
    for record in runtime.adapters.list_models():
        cards.append(ModelCard(id=record.name, created=record.created, owned_by=OWNER,
                               root=record.source, parent=base,
                               residency=runtime.adapters.residency(record.name, snapshot),
                               max_model_len=limit, version=record.entry.version,
                               sha256=record.entry.sha256,
                               resident_on=sorted(where.get(record.name, []))))
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
        await runtime.adapters.load(data.lora_name, data.lora_path, replace=data.load_inplace)
        return f"Success: LoRA adapter '{data.lora_name}' added successfully."

    @post("/unload_lora_adapter", status_code=200, media_type="text/plain",
          responses=_documented(str))
    async def unload_lora_adapter(self, data: UnloadLoRAAdapterRequest, runtime: Runtime) -> str:
        await runtime.unload_adapter(data.lora_name)
        return f"Success: LoRA adapter '{data.lora_name}' removed successfully."
