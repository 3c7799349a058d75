"""The tenant key routes and the audit log: thin handlers over `runtime.tenants`
(gateway/tenants/). DESIGN.md "Tenants" has the contract; the rules a mint obeys are here:

    who       the operator, or an admin key of that tenant (403 otherwise, and for a member)
    role      "admin" | "member"
    limits    positive; a tenant admin mints nothing looser than itself: a limit it has is the
              new key's ceiling and default, and its adapter globs bound the new key's
    open      a server without --admin-key or --api-key has no tenants to protect: minting
              there is refused (403), so keys never give a false sense of isolation
"""

from __future__ import annotations

import msgspec
from litestar import Controller, Request, delete, get, post
from litestar.params import Parameter

from loragw.gateway.errors import APIError
from loragw.gateway.http.auth import principal, require_admin_key
from loragw.gateway.http.error_handlers import error_responses
from loragw.gateway.runtime import Runtime
from loragw.gateway.tenants.access import forbidden
from loragw.gateway.tenants.audit import MAX_READ, AuditEntry, now_entry
from loragw.gateway.tenants.keys import ROLES, KeyRecord, Principal, check_globs, valid_tenant
from loragw.gateway.tenants.windows import Limits

MAX_GRACE_S = 30 * 24 * 3600


class CreateKey(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    adapters: list[str] | None = None
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None


class Rotate(msgspec.Struct, forbid_unknown_fields=True):
    grace_seconds: int = 0


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


def _tenant(request: Request, tenant: str) -> Principal:
    """The caller, if it may manage `tenant`'s keys."""
    caller = principal(request)
    if not caller.operator and caller.tenant != tenant:
        raise forbidden(f"this key may manage only tenant {caller.tenant!r}'s keys")
    if not valid_tenant(tenant):
        raise APIError.bad_request(f"tenant {tenant[:70]!r} is not a tenant name: "
                                   "[a-z0-9][a-z0-9-]{0,62}", param="tenant")
    config = request.app.state.config
    if config.admin_key is None and config.api_key is None:
        raise forbidden("this server runs without --admin-key: every caller is the operator, "
                        "so tenant keys would protect nothing; restart with --admin-key")
    return caller


def _limits(caller: Principal, data: CreateKey) -> Limits:
    values = {}
    for name in ("rpm", "tpm", "max_concurrency"):
        asked, ceiling = getattr(data, name), getattr(caller.limits, name)
        if asked is not None and asked < 1:
            raise APIError.bad_request(f"{name} must be at least 1, got {asked} (leave it out "
                                       "for no limit)", param=name)
        if ceiling is not None and (asked is None or asked > ceiling):
            if asked is not None:
                raise forbidden(f"{name} {asked} is above this key's own {name} {ceiling}")
            asked = ceiling
        values[name] = asked
    return Limits(**values)


def _globs(caller: Principal, data: CreateKey) -> tuple[str, ...]:
    try:
        globs = check_globs(data.adapters or [])
    except ValueError as exc:
        raise APIError.bad_request(str(exc), param="adapters") from None
    if caller.adapters and not globs:
        return caller.adapters
    if caller.adapters and not set(globs) <= set(caller.adapters):
        raise forbidden(f"adapters {sorted(set(globs) - set(caller.adapters))} are outside "
                        f"this key's own {list(caller.adapters)}")
    return globs


async def _key(runtime: Runtime, tenant: str, key_id: str) -> KeyRecord:
    await runtime.tenants.keys.sync()  # a key minted on another replica a moment ago
    record = runtime.tenants.keys.records.get(key_id)
    if record is None or record.tenant != tenant:
        raise APIError(404, f"tenant {tenant!r} has no key {key_id[:64]!r}", code="not_found")
    return record


class TenantKeyController(Controller):
    path = "/admin/tenants/{tenant:str}/keys"
    guards = [require_admin_key]
    tags = ["Tenants"]

    @post("/", status_code=201, responses=error_responses(400, 401, 403, 413, 503))
    async def create(self, request: Request, tenant: str, data: CreateKey,
                     runtime: Runtime) -> NewKey:
        caller = _tenant(request, tenant)
        if data.role not in ROLES:
            raise APIError.bad_request(f"role must be one of {list(ROLES)}, got {data.role!r}",
                                       param="role")
        record, secret = await runtime.tenants.keys.create(
            tenant, data.role, _globs(caller, data), _limits(caller, data))
        await runtime.tenants.audit.append(now_entry(caller, "key.created", owner=tenant,
                                                     target_key_id=record.id))
        return NewKey.of(record, key=secret)

    @get("/", responses=error_responses(400, 401, 403, 503))
    async def list_keys(self, request: Request, tenant: str, runtime: Runtime) -> KeyList:
        _tenant(request, tenant)
        await runtime.tenants.keys.sync()
        used = await runtime.tenants.keys.last_used()
        records = sorted((r for r in runtime.tenants.keys.records.values()
                          if r.tenant == tenant), key=lambda r: (r.created, r.id))
        return KeyList([KeyInfo.of(r, last_used=_second(used.get(r.id))) for r in records])

    @post("/{key_id:str}/rotate", status_code=200,
          responses=error_responses(400, 401, 403, 404, 413, 503))
    async def rotate(self, request: Request, tenant: str, key_id: str, runtime: Runtime,
                     data: Rotate | None = None) -> NewKey:
        caller = _tenant(request, tenant)
        grace = (data or Rotate()).grace_seconds
        if not 0 <= grace <= MAX_GRACE_S:
            raise APIError.bad_request(f"grace_seconds must be in [0, {MAX_GRACE_S}], got "
                                       f"{grace}", param="grace_seconds")
        record, secret = await runtime.tenants.keys.rotate(
            await _key(runtime, tenant, key_id), grace)
        await runtime.tenants.audit.append(now_entry(caller, "key.rotated", owner=tenant,
                                                     target_key_id=record.id))
        until = int(record.old_until) if record.old_hash else None
        return NewKey.of(record, key=secret, previous_key_valid_until=until)

    @delete("/{key_id:str}", status_code=200, responses=error_responses(400, 401, 403, 404, 503))
    async def revoke(self, request: Request, tenant: str, key_id: str,
                     runtime: Runtime) -> KeyInfo:
        caller = _tenant(request, tenant)
        record = await _key(runtime, tenant, key_id)
        await runtime.tenants.keys.revoke(record)
        await runtime.tenants.audit.append(now_entry(caller, "key.revoked", owner=tenant,
                                                     target_key_id=record.id))
        return KeyInfo.of(record)


class AuditController(Controller):
    path = "/admin/audit"
    guards = [require_admin_key]
    tags = ["Tenants"]

    @get("/", responses=error_responses(400, 401, 403, 503))
    async def audit(self, request: Request, runtime: Runtime,
                    limit: int = Parameter(default=100, ge=1, le=MAX_READ)) -> AuditList:
        """Newest first: every entry to the operator, a tenant's own to its admin keys."""
        return AuditList(await runtime.tenants.audit.read(limit, principal(request).tenant))
