"""The admin API: upload, register, list/get with residency, load, evict, pin,
unpin, delete. Thin handlers over the residency manager (gateway/residency/manager.py).

Adapter ids may hold one '/' (ORG/REPO), so the per-adapter routes take the rest of the path
and split a trailing action off it: `POST /admin/adapters/org/repo/load`. Each handler asks
gateway/tenants/access.py whether its caller may see or change the id (404 / 403), and
appends what it changed to the audit log.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, delete, get, post
from litestar.datastructures import UploadFile

from loragw.adapters.chat_files import (
    GENERATION_CONFIG,
    MAX_CHAT_FILE_BYTES,
    TEMPLATE_FILE,
    TOKENIZER_CONFIG,
    AdapterChat,
)
from loragw.adapters.ids import valid_adapter_id
from loragw.gateway.common.errors import APIError
from loragw.gateway.common.flags import parse_bool
from loragw.gateway.common.records import not_registered
from loragw.gateway.http.auth import principal, require_admin_key
from loragw.gateway.http.capacity import Capacity
from loragw.gateway.http.error_handlers import error_responses
from loragw.gateway.http.openapi_docs import (
    ADAPTER_ID,
    OWNER,
    MultipartUpload,
    adapter_action,
    documented,
    path_parameter,
)
from loragw.gateway.http.strict_body import strict_body
from loragw.gateway.http.upload_body import UploadBody
from loragw.gateway.residency import aliases
from loragw.gateway.residency.drafts import check_draft_source
from loragw.gateway.residency.info import AdapterInfo
from loragw.gateway.residency.manager import AdapterManager
from loragw.gateway.tenants.access import check_change, check_source, check_visible, owner_for_write
from loragw.gateway.tenants.audit import AuditLog, now_entry
from loragw.gateway.tenants.keys import Principal

# the upload's chat parts -> the file each stands for (text fields or files)
CHAT_PARTS = {"chat_template": TEMPLATE_FILE, "tokenizer_config": TOKENIZER_CONFIG,
              "generation_config": GENERATION_CONFIG}
DONE = {"load": "loaded", "evict": "evicted", "pin": "pinned", "unpin": "unpinned"}
ACTIONS = tuple(DONE)


class AdapterList(msgspec.Struct):
    data: list[AdapterInfo]
    object: str = "list"


AdapterId = Annotated[str, path_parameter(ADAPTER_ID)]
AdapterAction = Annotated[str, path_parameter(adapter_action(ACTIONS))]


class RegisterRequest(msgspec.Struct, forbid_unknown_fields=True):
    adapter_id: Annotated[str, documented(ADAPTER_ID)]
    source: str
    replace: bool = False
    owner: Annotated[str, documented(OWNER)] | None = None  # the operator's: its tenant ("": shared)
    draft_adapter: str | None = None  # the source of its draft-model LoRA (speculative)
    # its own chat, over the chat files its source holds (adapters/chat_files.py)
    chat_template: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    generation_config: dict[str, Any] | None = None  # as generation_config.json holds it

    def chat(self) -> AdapterChat:
        generation = json.dumps(self.generation_config) if self.generation_config else ""
        return AdapterChat(self.chat_template or "", self.reasoning_parser or "",
                           self.tool_call_parser or "", generation)


class Deleted(msgspec.Struct):
    id: str
    deleted: bool = True


async def audited(audit: AuditLog, caller: Principal, action: str, info: AdapterInfo) -> None:
    await audit.append(now_entry(caller, action, adapter_id=info.id, version=info.version,
                                 sha256=info.sha256, owner=info.owner))


async def write(adapters: AdapterManager, audit: AuditLog, request: Request, adapter_id: str,
                owner: str | None, action: str, add, source: str | None = None,
                draft: str | None = None) -> AdapterInfo:
    """An upload or a registration (from `source`; `draft`: its draft-model LoRA's source) of
    `adapter_id` (`add(owner)` does it), if the caller may, audited as an add or a replace."""
    caller = principal(request)
    owner, existed = await owner_for_write(adapters.catalog, caller, adapter_id, owner)
    check_draft_source(draft)
    for fetched in (s for s in (source, draft) if s is not None):
        check_source(caller, fetched, adapters.hub_allow, adapters.s3_allow)
    info = await add(owner)
    await audited(audit, caller, "adapter.replaced" if existed else action, info)
    return info


class AdminController(Controller):
    path = "/admin/adapters"
    guards = [require_admin_key]
    before_request = strict_body  # no string-to-number coercion of bodies and queries
    tags = ["Admin"]

    @get("/", responses=error_responses(401, 403, 503))
    async def list_adapters(self, request: Request, adapters: AdapterManager) -> AdapterList:
        caller = principal(request)
        return AdapterList([a for a in await adapters.list() if caller.may_use(a.id, a.owner)])

    @get("/{adapter_id:path}", responses=error_responses(
        400, 401, 403, 404, 503, e400="the adapter id is not valid"))
    async def get_adapter(self, request: Request, adapter_id: AdapterId,
                          adapters: AdapterManager) -> AdapterInfo:
        return await adapters.get(await check_visible(adapters.catalog, principal(request),
                                                      adapter_id.strip("/")))

    # The body's own size cap and read timeout (--max-upload-mb, --upload-timeout-s), in
    # place of the app's --max-request-mb: gateway/http/upload_body.py.
    @post("/", status_code=201, operation_class=MultipartUpload, request_max_body_size=None,
          middleware=[UploadBody()],
          responses=error_responses(400, 401, 403, 408, 409, 413, 422, 503, e409="the id "
                                    "exists (send replace=true to replace it)"))
    async def upload(self, request: Request[Any, Any, Any], adapters: AdapterManager,
                     audit: AuditLog) -> AdapterInfo:
        """multipart: `adapter_id`, `adapter_config` (file), `adapter_model` (file),
        optional `replace`=true, optional `owner` (the operator's: a tenant; empty: shared),
        optional `draft_adapter` (the source of its draft-model LoRA), and its own chat:
        `chat_template`, `tokenizer_config`, `generation_config` (text or files),
        `reasoning_parser`, `tool_call_parser`."""
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise APIError.bad_request("upload as multipart/form-data with fields adapter_id, "
                                       "adapter_config and adapter_model")
        form = await request.form()
        adapter_id = _text(form, "adapter_id")
        replace = _flag(_text(form, "replace", required=False) or "")
        config_raw = await _file(form, "adapter_config")
        weights_raw = await _file(form, "adapter_model")
        draft = _text(form, "draft_adapter", required=False) or None
        chat = AdapterChat("", _text(form, "reasoning_parser", required=False) or "",
                           _text(form, "tool_call_parser", required=False) or "")
        chat_files = {name: raw for field, name in CHAT_PARTS.items()
                      if (raw := await _chat_part(form, field)) is not None}

        async def add(owner: str | None) -> AdapterInfo:
            return await adapters.upload(adapter_id, config_raw, weights_raw, replace, owner,
                                         draft or "", chat, chat_files)

        return await write(adapters, audit, request, adapter_id,
                           _text(form, "owner", required=False), "adapter.uploaded", add,
                           draft=draft)

    @post("/register", status_code=201, responses=error_responses(
        400, 401, 403, 404, 409, 413, 422, 502, 503, e404="the source does not exist",
        e409="the id exists (send replace=true to replace it)"))
    async def register(self, request: Request, data: RegisterRequest, adapters: AdapterManager,
                       audit: AuditLog) -> AdapterInfo:
        async def add(owner: str | None) -> AdapterInfo:
            return await adapters.register(data.adapter_id, data.source, data.replace, owner,
                                           data.draft_adapter or "", data.chat())

        return await write(adapters, audit, request, data.adapter_id, data.owner,
                           "adapter.registered", add, data.source, data.draft_adapter)

    # One path with GET and DELETE (so OPTIONS lists all three): `adapter_id` is ID/ACTION here
    @post("/{adapter_id:path}", status_code=200, responses=error_responses(
        400, 401, 403, 404, 409, 422, 502, 503, e404="no such adapter, or no such action",
        e409="evict: the adapter is in use by running requests, or pinned"))
    async def action(self, request: Request, adapter_id: AdapterAction, adapters: AdapterManager,
                     audit: AuditLog) -> AdapterInfo:
        """`{adapter_id}/load|evict|pin|unpin`."""
        target = adapter_id
        adapter_id, _, verb = target.strip("/").rpartition("/")
        if verb not in ACTIONS or not adapter_id:
            raise APIError(404, f"no admin route POST /admin/adapters/{target.strip('/')}; "
                                f"use /admin/adapters/ID/{{{'|'.join(ACTIONS)}}}",
                           code="not_found")
        caller = principal(request)
        adapter_id = await check_change(adapters.catalog, caller, adapter_id)
        if verb == "load":
            info = await adapters.load(adapter_id)
        elif verb == "evict":
            info = await adapters.evict(adapter_id)
        else:
            info = await adapters.pin(adapter_id, verb == "pin")
        await audited(audit, caller, f"adapter.{DONE[verb]}", info)
        return info

    @delete("/{adapter_id:path}", status_code=200, responses=error_responses(
        400, 401, 403, 404, 409, 503, e409="an alias points at it (?force=true deletes it "
        "anyway, leaving the alias dangling)"))
    async def delete_adapter(self, request: Request, adapter_id: AdapterId, adapters: AdapterManager,
                             audit: AuditLog, capacity: Capacity, force: bool = False) -> Deleted:
        return Deleted(await remove(adapters, audit, capacity, principal(request),
                                    adapter_id.strip("/"), force=force))


async def remove(adapters: AdapterManager, audit: AuditLog, capacity: Capacity,
                 caller: Principal, raw: str, lenient: bool = False, force: bool = False) -> str:
    """Delete an adapter the caller may change, first ending its requests in flight (their
    clients get finish_reason "abort"); audited. 409 while an alias points at it, unless
    `force`. `lenient` (vLLM's unload): an invalid name is just one that is not loaded (404),
    as vLLM answers."""
    if lenient and not valid_adapter_id(raw):
        raise not_registered(raw)
    adapter_id = await check_change(adapters.catalog, caller, raw)
    info = await adapters.get(adapter_id)  # 404 if it is not registered
    await aliases.targeting(adapters, adapter_id, caller, force)
    capacity.abort(adapter_id)
    await adapters.delete(adapter_id)
    await audited(audit, caller, "adapter.deleted", info)
    return adapter_id


def _text(form, name: str, required: bool = True) -> str | None:
    value = form.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise APIError.bad_request(f"multipart field {name!r} is required as a text field",
                                   param=name)
    return value


def _flag(value: str) -> bool:
    if not value.strip():
        return False
    try:
        return parse_bool(value)
    except ValueError as exc:
        raise APIError.bad_request(f"replace: {exc}", param="replace") from None


async def _file(form, name: str) -> bytes:
    value = form.get(name)
    if not isinstance(value, UploadFile):
        raise APIError.bad_request(f"multipart file field {name!r} is required "
                                   f"({'adapter_config.json' if name == 'adapter_config' else 'adapter_model.safetensors'})",
                                   param=name)
    return await value.read()


async def _chat_part(form, name: str) -> bytes | None:
    """An optional chat part, as text or a file; 413 past its cap."""
    value = form.get(name)
    if value is None:
        return None
    raw = await value.read() if isinstance(value, UploadFile) else str(value).encode()
    if len(raw) > MAX_CHAT_FILE_BYTES:
        raise APIError(413, f"multipart field {name!r} is larger than {MAX_CHAT_FILE_BYTES} "
                            "bytes", param=name, code="request_too_large")
    return raw
