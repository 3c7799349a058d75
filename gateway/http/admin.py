"""The admin API: upload, register, list/get with residency, load, evict, pin,
unpin, delete. Thin handlers over `runtime.adapters` (gateway/residency/manager.py).

Adapter ids may hold one '/' (ORG/REPO), so the per-adapter routes take the rest of the path
and split a trailing action off it: `POST /admin/adapters/org/repo/load`.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, delete, get, post
from litestar.datastructures import UploadFile

from adapters.ids import validate_adapter_id
from gateway.errors import APIError
from gateway.flags import parse_bool
from gateway.http.auth import require_admin_key
from gateway.http.error_handlers import error_responses
from gateway.http.openapi_docs import MultipartUpload
from gateway.http.upload_body import UploadBody
from gateway.residency.info import AdapterInfo
from gateway.residency.manager import AdapterManager
from gateway.runtime import Runtime

ACTIONS = ("load", "evict", "pin", "unpin")


class AdapterList(msgspec.Struct):
    data: list[AdapterInfo]
    object: str = "list"


class RegisterRequest(msgspec.Struct, forbid_unknown_fields=True):
    adapter_id: str
    source: str
    replace: bool = False


class Deleted(msgspec.Struct):
    id: str
    deleted: bool = True


def _manager(runtime: Runtime) -> AdapterManager:
    runtime.check_ready()
    return runtime.adapters


def _id(raw: str) -> str:
    return validate_adapter_id(raw.strip("/"))


class AdminController(Controller):
    path = "/admin/adapters"
    guards = [require_admin_key]
    tags = ["Admin"]

    @get("/", responses=error_responses(401, 503))
    async def list_adapters(self, runtime: Runtime) -> AdapterList:
        return AdapterList(await _manager(runtime).list())

    @get("/{adapter_id:path}", responses=error_responses(
        400, 401, 404, 503, e400="the adapter id is not valid"))
    async def get_adapter(self, adapter_id: str, runtime: Runtime) -> AdapterInfo:
        return await _manager(runtime).get(_id(adapter_id))

    # The body's own size cap and read timeout (--max-upload-mb, --upload-timeout-s), in
    # place of the app's --max-request-mb: gateway/http/upload_body.py.
    @post("/", status_code=201, operation_class=MultipartUpload, request_max_body_size=None,
          middleware=[UploadBody()],
          responses=error_responses(400, 401, 408, 409, 413, 422, 503, e409="the id exists "
                                    "(send replace=true to replace it)"))
    async def upload(self, request: Request[Any, Any, Any], runtime: Runtime) -> AdapterInfo:
        """multipart: `adapter_id`, `adapter_config` (file), `adapter_model` (file),
        optional `replace`=true."""
        manager = _manager(runtime)
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise APIError.bad_request("upload as multipart/form-data with fields adapter_id, "
                                       "adapter_config and adapter_model")
        form = await request.form()
        adapter_id = _text(form, "adapter_id")
        replace = _flag(_text(form, "replace", required=False) or "")
        config_raw = await _file(form, "adapter_config")
        weights_raw = await _file(form, "adapter_model")
        return await manager.upload(adapter_id, config_raw, weights_raw, replace)

    @post("/register", status_code=201, responses=error_responses(
        400, 401, 404, 409, 413, 422, 502, 503, e404="the source does not exist",
        e409="the id exists (send replace=true to replace it)"))
    async def register(self, data: RegisterRequest, runtime: Runtime) -> AdapterInfo:
        return await _manager(runtime).register(data.adapter_id, data.source, data.replace)

    @post("/{target:path}", status_code=200, responses=error_responses(
        400, 401, 404, 409, 422, 502, 503, e404="no such adapter, or no such action",
        e409="evict: the adapter is in use by running requests, or pinned"))
    async def action(self, target: str, runtime: Runtime) -> AdapterInfo:
        """`{adapter_id}/load|evict|pin|unpin`."""
        adapter_id, _, verb = target.strip("/").rpartition("/")
        if verb not in ACTIONS or not adapter_id:
            raise APIError(404, f"no admin route POST /admin/adapters/{target.strip('/')}; "
                                f"use /admin/adapters/ID/{{{'|'.join(ACTIONS)}}}",
                           code="not_found")
        manager, adapter_id = _manager(runtime), _id(adapter_id)
        if verb == "load":
            return await manager.load(adapter_id)
        if verb == "evict":
            return await manager.evict(adapter_id)
        return await manager.pin(adapter_id, verb == "pin")

    @delete("/{adapter_id:path}", status_code=200,
            responses=error_responses(400, 401, 404, 503))
    async def delete_adapter(self, adapter_id: str, runtime: Runtime) -> Deleted:
        adapter_id = _id(adapter_id)
        await runtime.unload_adapter(adapter_id)  # ends its in-flight requests, then deletes
        return Deleted(adapter_id)


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
