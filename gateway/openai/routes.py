"""POST /v1/completions, POST /v1/chat/completions, GET /v1/models, and vLLM's adapter
load/unload routes. Handlers decode (Litestar) and hand the body to admission
(gateway/openai/admission.py), which returns a Struct or an SSE stream.
"""

from __future__ import annotations

from litestar import Controller, Request, Response, get, post
from litestar.openapi import ResponseSpec

from loragw.gateway.admin.adapters import remove, write
from loragw.gateway.common.errors import APIError
from loragw.gateway.http.auth import principal, require_admin_key, require_api_key
from loragw.gateway.http.capacity import Capacity
from loragw.gateway.http.error_handlers import error_responses
from loragw.gateway.http.openapi_docs import streamed
from loragw.gateway.http.response_bodies import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from loragw.gateway.http.served import ServedModel, ServedModelDep
from loragw.gateway.openai.admission import (
    Admission,
    AdmissionDep,
    serve_chat,
    serve_completion,
)
from loragw.gateway.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from loragw.gateway.residency.info import AdapterInfo
from loragw.gateway.residency.manager import AdapterManager
from loragw.gateway.tenants.audit import AuditLog
from loragw.gateway.tenants.keys import Principal

OWNER = "lora-gateway"
# a model may name an adapter fetched on first use (the Hub, the fleet's store) or held by
# another replica: every adapter status can answer a generation request
GENERATION_ERRORS = error_responses(400, 401, 404, 413, 422, 429, 502, 503)
ADAPTER_ERRORS = error_responses(400, 401, 403, 404, 413, 422, 502, 503,
                                 e400="invalid body, or the name is taken (`adapter_exists`)",
                                 e404="no such adapter, or no such source path")


def _documented(success: type, errors: dict[int, ResponseSpec]) -> dict[int, ResponseSpec]:
    """OpenAPI: the real success body and OpenAI-shaped errors (not Litestar's defaults)."""
    media = "text/plain" if success is str else "application/json"
    return {200: ResponseSpec(success, description=success.__name__, media_type=media,
                              generate_examples=False), **errors}


class OpenAIController(Controller):
    path = "/v1"
    guards = [require_api_key]
    tags = ["OpenAI"]

    @post("/completions", status_code=200,
          operation_class=streamed(CompletionResponse, ErrorResponse),
          responses=_documented(CompletionResponse, GENERATION_ERRORS))
    async def completions(self, request: Request, data: CompletionRequest,
                          admission: AdmissionDep) -> Response:
        return await serve_completion(request, data, admission)

    @post("/chat/completions", status_code=200,
          operation_class=streamed(ChatCompletionChunk, ErrorResponse),
          responses=_documented(ChatCompletionResponse, GENERATION_ERRORS))
    async def chat_completions(self, request: Request, data: ChatCompletionRequest,
                               admission: AdmissionDep) -> Response:
        return await serve_chat(request, data, admission)

    @get("/models", responses=error_responses(401, 503))
    async def models(self, request: Request, served: ServedModelDep,
                     admission: AdmissionDep) -> ModelList:
        """The base model and the adapters this key may use."""
        return ModelList(data=await _model_cards(served, admission, principal(request)))

    @get("/models/{model_id:path}", responses=error_responses(400, 401, 404, 503))
    async def model(self, request: Request, model_id: str, served: ServedModelDep,
                    admission: AdmissionDep) -> ModelCard:
        """One entry of /v1/models (the `openai` client's models.retrieve); ids may hold a /."""
        model_id = model_id.lstrip("/")
        for card in await _model_cards(served, admission, principal(request)):
            if card.id == model_id:
                return card
        raise APIError.model_not_found(model_id)


async def _model_cards(model: ServedModel, admission: Admission,
                       caller: Principal) -> list[ModelCard]:
    adapters, chats = admission.adapters, admission.chats
    snapshot = await adapters.engine.snapshot()
    base, limit = model.name, model.info.max_model_len
    cards = [ModelCard(id=base, created=model.started_at, owned_by=OWNER, root=model.path,
                       parent=None, residency="device", max_model_len=limit,
                       reasoning_parser=chats.base.reasoning, tool_call_parser=chats.base.tools)]
    where = await adapters.resident_on()
    for record in adapters.records.values():
        if not caller.may_use(record.name, record.entry.owner):
            continue
        chat = chats.setup(record.entry.chat)  # how it speaks: its own, else as the base
        cards.append(ModelCard(id=record.name, created=record.created,
                               owned_by=record.entry.owner or OWNER,
                               root=record.source, parent=base,
                               residency=adapters.residency(record.name, snapshot),
                               max_model_len=limit, version=record.entry.version,
                               sha256=record.entry.sha256,
                               resident_on=sorted(where.get(record.name, [])),
                               reasoning_parser=chat.reasoning, tool_call_parser=chat.tools))
    return cards


class AdapterLoadController(Controller):
    """vLLM's runtime adapter routes; unlike vLLM's, unload frees the adapter's memory."""

    path = "/v1"
    guards = [require_admin_key]
    tags = ["Adapters (vLLM-compatible)"]

    @post("/load_lora_adapter", status_code=200, media_type="text/plain",
          responses=_documented(str, ADAPTER_ERRORS))
    async def load_lora_adapter(self, request: Request, data: LoadLoRAAdapterRequest,
                                adapters: AdapterManager, audit: AuditLog) -> str:
        async def add(owner: str | None) -> AdapterInfo:
            return await adapters.load(data.lora_name, data.lora_path,
                                       replace=data.load_inplace, owner=owner)

        await write(adapters, audit, request, data.lora_name, None, "adapter.registered", add,
                    data.lora_path)
        return f"Success: LoRA adapter '{data.lora_name}' added successfully."

    @post("/unload_lora_adapter", status_code=200, media_type="text/plain",
          responses=_documented(str, error_responses(400, 401, 403, 404, 413, 503)))
    async def unload_lora_adapter(self, request: Request, data: UnloadLoRAAdapterRequest,
                                  adapters: AdapterManager, audit: AuditLog,
                                  capacity: Capacity) -> str:
        await remove(adapters, audit, capacity, principal(request), data.lora_name,
                     lenient=True)
        return f"Success: LoRA adapter '{data.lora_name}' removed successfully."
