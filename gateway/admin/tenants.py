"""The tenant key routes and the audit log: thin handlers over the key ring and the audit log
(gateway/tenants/). DESIGN.md "Tenants" has the contract; the rules a mint obeys are
gateway/tenants/minting.py's."""

from __future__ import annotations

from typing import Annotated

import msgspec
from litestar import Controller, Request, delete, get, post
from litestar.params import Parameter
from msgspec import Meta

from loragw.gateway.common.config import ServerConfig
from loragw.gateway.common.errors import APIError
from loragw.gateway.http.auth import principal, require_admin_key
from loragw.gateway.http.error_handlers import error_responses
from loragw.gateway.http.openapi_docs import (
    ROLE,
    TENANT,
    OptionalBody,
    documented,
    path_parameter,
)
from loragw.gateway.http.strict_body import strict_body
from loragw.gateway.tenants.audit import MAX_READ, AuditEntry, AuditLog, now_entry
from loragw.gateway.tenants.keyring import KeyRing
from loragw.gateway.tenants.keys import KeyRecord, Principal
from loragw.gateway.tenants.minting import (
    MAX_CONCURRENCY,
    MAX_GRACE_S,
    MAX_RPM,
    MAX_TPM,
    check_grace,
    check_manager,
    check_role,
    new_key_globs,
    new_key_limits,
)

Tenant = Annotated[str, path_parameter(TENANT)]


class CreateKey(msgspec.Struct, forbid_unknown_fields=True):
    role: Annotated[str, documented(ROLE)]
    adapters: list[str] | None = None  # globs: TENANT/NAME-PATTERN
    rpm: Annotated[int, Meta(ge=1, le=MAX_RPM)] | None = None
    tpm: Annotated[int, Meta(ge=1, le=MAX_TPM)] | None = None
    max_concurrency: Annotated[int, Meta(ge=1, le=MAX_CONCURRENCY)] | None = None


class Rotate(msgspec.Struct, forbid_unknown_fields=True):
    grace_seconds: Annotated[int, Meta(ge=0, le=MAX_GRACE_S)] = 0


class KeyFields(msgspec.Struct):
    """What a key is (never its secret): shared by a listing and a mint."""

    id: str
    tenant: str
    role: str
    adapters: list[str]
    rpm: int | None
    tpm: int | None
    max_concurrency: int | None
    created: int

    @classmethod
    def of(cls, record: KeyRecord, **extra):
        return cls(record.id, record.tenant, record.role, list(record.adapters), record.rpm,
                   record.tpm, record.max_concurrency, record.created, **extra)


class KeyInfo(KeyFields):
    """A key as listed (and as revoked)."""

    last_used: int | None = None  # unix time; null: never used


class NewKey(KeyFields, omit_defaults=True):
    """A key as minted or rotated: the secret, shown this once."""

    key: str
    previous_key_valid_until: int | None = None  # after a rotation with a grace period


class KeyList(msgspec.Struct):
    data: list[KeyInfo]
    object: str = "list"


class AuditList(msgspec.Struct):
    data: list[AuditEntry]
    object: str = "list"


def _second(unix: float | None) -> int | None:
    return int(unix) if unix is not None else None


def _manager(request: Request, tenant: str, config: ServerConfig) -> Principal:
    """The caller, if it may manage `tenant`'s keys."""
    caller = principal(request)
    check_manager(caller, tenant, config)
    return caller


async def _key(keys: KeyRing, tenant: str, key_id: str) -> KeyRecord:
    await keys.sync()  # a key minted on another replica a moment ago
    record = keys.records.get(key_id)
    if record is None or record.tenant != tenant:
        raise APIError(404, f"tenant {tenant!r} has no key {key_id[:64]!r}", code="not_found")
    return record


class TenantKeyController(Controller):
    path = "/admin/tenants/{tenant:str}/keys"
    guards = [require_admin_key]
    before_request = strict_body  # no string-to-number coercion of bodies and queries
    tags = ["Tenants"]

    @post("/", status_code=201, responses=error_responses(400, 401, 403, 413, 503))
    async def create(self, request: Request, tenant: Tenant, data: CreateKey, keys: KeyRing,
                     audit: AuditLog, config: ServerConfig) -> NewKey:
        caller = _manager(request, tenant, config)
        asked = {"rpm": data.rpm, "tpm": data.tpm, "max_concurrency": data.max_concurrency}
        record, secret = await keys.create(tenant, check_role(data.role),
                                           new_key_globs(caller, tenant, data.adapters),
                                           new_key_limits(caller, asked))
        await audit.append(now_entry(caller, "key.created", owner=tenant,
                                     target_key_id=record.id))
        return NewKey.of(record, key=secret)

    @get("/", responses=error_responses(400, 401, 403, 503))
    async def list_keys(self, request: Request, tenant: Tenant, keys: KeyRing,
                        config: ServerConfig) -> KeyList:
        _manager(request, tenant, config)
        await keys.sync()
        used = await keys.last_used()
        records = sorted((r for r in keys.records.values()
                          if r.tenant == tenant), key=lambda r: (r.created, r.id))
        return KeyList([KeyInfo.of(r, last_used=_second(used.get(r.id))) for r in records])

    @post("/{key_id:str}/rotate", status_code=200, operation_class=OptionalBody,
          responses=error_responses(400, 401, 403, 404, 413, 503))
    async def rotate(self, request: Request, tenant: Tenant, key_id: str, keys: KeyRing,
                     audit: AuditLog, config: ServerConfig,
                     data: Rotate | None = None) -> NewKey:
        caller = _manager(request, tenant, config)
        grace = check_grace((data or Rotate()).grace_seconds)
        record, secret = await keys.rotate(await _key(keys, tenant, key_id), grace)
        await audit.append(now_entry(caller, "key.rotated", owner=tenant,
                                     target_key_id=record.id))
        until = int(record.old_until) if record.old_hash else None
        return NewKey.of(record, key=secret, previous_key_valid_until=until)

    @delete("/{key_id:str}", status_code=200, responses=error_responses(400, 401, 403, 404, 503))
    async def revoke(self, request: Request, tenant: Tenant, key_id: str, keys: KeyRing,
                     audit: AuditLog, config: ServerConfig) -> KeyInfo:
        caller = _manager(request, tenant, config)
        record = await _key(keys, tenant, key_id)
        await keys.revoke(record)
        await audit.append(now_entry(caller, "key.revoked", owner=tenant,
                                     target_key_id=record.id))
        return KeyInfo.of(record)


class AuditController(Controller):
    path = "/admin/audit"
    guards = [require_admin_key]
    before_request = strict_body  # no string-to-number coercion of bodies and queries
    tags = ["Tenants"]

    @get("/", responses=error_responses(400, 401, 403, 503))
    async def audit(self, request: Request, audit: AuditLog,
                    limit: int = Parameter(default=100, ge=1, le=MAX_READ)) -> AuditList:
        """Newest first: every entry to the operator, a tenant's own to its admin keys."""
        return AuditList(await audit.read(limit, principal(request).tenant))
