"""The alias routes: thin handlers over gateway/residency/aliases.py, guarded as the other
/admin routes are, and audited (`alias.created`, `alias.updated`, `alias.deleted`).

    PUT    /admin/aliases/{alias}   {"targets": [{"adapter": "bot@3", "weight": 90}, ...],
                                     "owner"?: tenant | ""}  -> 200 Alias
    GET    /admin/aliases/{alias}   -> 200 Alias | 404
    GET    /admin/aliases           -> 200 {"data": [Alias...]}: those the key may use
    DELETE /admin/aliases/{alias}   -> 200 {"alias", "deleted": true} | 404

Alias names may hold one '/' (TENANT/NAME), so the routes take the rest of the path.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from litestar import Controller, Request, delete, get, put
from msgspec import Meta

from loragw.adapters.aliases import MAX_TARGETS, MAX_WEIGHT, Alias, AliasTarget
from loragw.gateway.http.auth import principal, require_admin_key
from loragw.gateway.http.error_handlers import error_responses
from loragw.gateway.http.openapi_docs import (
    ADAPTER_ID,
    ADAPTER_TARGET,
    OWNER,
    documented,
    path_parameter,
)
from loragw.gateway.http.strict_body import strict_body
from loragw.gateway.residency import aliases
from loragw.gateway.residency.manager import AdapterManager
from loragw.gateway.tenants.audit import AuditLog, now_entry
from loragw.gateway.tenants.keys import Principal

AliasName = Annotated[str, path_parameter(ADAPTER_ID)]  # named as adapter ids are


class TargetBody(msgspec.Struct, forbid_unknown_fields=True):
    adapter: Annotated[str, documented(ADAPTER_TARGET)]  # ID, ID@N or ID@sha256:HEXPREFIX
    weight: Annotated[int, Meta(ge=0, le=MAX_WEIGHT)]


class PutAlias(msgspec.Struct, forbid_unknown_fields=True):
    targets: Annotated[list[TargetBody], Meta(min_length=1, max_length=MAX_TARGETS)]
    owner: Annotated[str, documented(OWNER)] | None = None  # the operator's: its tenant ("": shared)


class AliasInfo(msgspec.Struct):
    alias: str
    targets: list[TargetBody]
    owner: str  # "": shared; else its tenant
    updated_at: int  # unix seconds of the last PUT
    object: str = "alias"

    @classmethod
    def of(cls, alias: Alias) -> AliasInfo:
        return cls(alias.alias, [TargetBody(t.adapter, t.weight) for t in alias.targets],
                   alias.owner, alias.updated_at)


class AliasList(msgspec.Struct):
    data: list[AliasInfo]
    object: str = "list"


class AliasDeleted(msgspec.Struct):
    alias: str
    deleted: bool = True


async def _audit(audit: AuditLog, caller: Principal, action: str, alias: Alias) -> None:
    await audit.append(now_entry(caller, action, adapter_id=alias.alias,
                                                 owner=alias.owner))


class AliasController(Controller):
    path = "/admin/aliases"
    guards = [require_admin_key]
    before_request = strict_body  # no string-to-number coercion of bodies and queries
    tags = ["Admin"]

    @get("/", responses=error_responses(401, 403, 503))
    async def list_aliases(self, request: Request, adapters: AdapterManager) -> AliasList:
        found = await aliases.listed(adapters, principal(request))
        return AliasList([AliasInfo.of(a) for a in found])

    @get("/{alias:path}", responses=error_responses(400, 401, 403, 404, 503))
    async def get_alias(self, request: Request, alias: AliasName,
                        adapters: AdapterManager) -> AliasInfo:
        found = await aliases.visible(adapters, principal(request), alias.strip("/"))
        return AliasInfo.of(found)

    @put("/{alias:path}", status_code=200, responses=error_responses(
        400, 401, 403, 404, 409, 503, e404="a target does not exist (or the key may not use "
        "it)", e409="the name is an adapter's id, or a target is an alias"))
    async def put_alias(self, request: Request, alias: AliasName, data: PutAlias,
                        adapters: AdapterManager, audit: AuditLog) -> AliasInfo:
        caller = principal(request)
        targets = [AliasTarget(t.adapter, t.weight) for t in data.targets]
        stored, existed = await aliases.put(adapters, caller, alias.strip("/"),
                                            targets, data.owner)
        await _audit(audit, caller, "alias.updated" if existed else "alias.created", stored)
        return AliasInfo.of(stored)

    @delete("/{alias:path}", status_code=200, responses=error_responses(400, 401, 403, 404, 503))
    async def delete_alias(self, request: Request, alias: AliasName, adapters: AdapterManager,
                           audit: AuditLog) -> AliasDeleted:
        caller = principal(request)
        gone = await aliases.delete(adapters, caller, alias.strip("/"))
        await _audit(audit, caller, "alias.deleted", gone)
        return AliasDeleted(gone.alias)
