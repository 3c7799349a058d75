"""The tenant rules on the admin and adapter routes, each answered as DESIGN.md "Tenants" says:
an adapter a key may not use is a 404 exactly like one that does not exist (an invalid id too,
to a tenant key: it names nothing the key may use); a write outside the caller's namespace, or
to an adapter it may use but does not own, is a 403. The request path's own check (a model a
key may not use) is in AdapterManager.locate.

Every check reads the catalog's owner now (`FleetCatalog.owner` refreshes the entry), so
an adapter moved to another tenant on any replica is judged by its current owner.
"""

from __future__ import annotations

from typing import Protocol

from loragw.adapters.errors import AdapterNotFound, InvalidAdapterId
from loragw.adapters.ids import validate_adapter_id
from loragw.adapters.sources import InvalidSource, hub_allowed, parse_source, s3_allowed
from loragw.gateway.common.errors import APIError
from loragw.gateway.common.records import not_registered
from loragw.gateway.tenants.keys import Principal, valid_tenant


class Owners(Protocol):
    """Who owns each adapter of the fleet's catalog (residency's FleetCatalog answers)."""

    async def owner(self, adapter_id: str) -> str | None:
        """The owning tenant; None for a shared adapter or one that does not exist."""


def forbidden(message: str) -> APIError:
    return APIError(403, message, code="permission_denied")


def checked_id(principal: Principal, raw: str) -> str:
    """A valid adapter id; an invalid one is a 400 to the operator, a 404 to a tenant key."""
    try:
        return validate_adapter_id(raw)
    except InvalidAdapterId:
        if principal.operator:
            raise
        raise not_registered(raw) from None


async def _visible(owners: Owners, principal: Principal,
                   raw: str) -> tuple[str, str | None]:
    """(the id, its owner: None if no such adapter), if `principal` may use it; else the
    unknown adapter's 404."""
    adapter_id = checked_id(principal, raw)
    owner = await owners.owner(adapter_id)
    if owner is not None and not principal.may_use(adapter_id, owner):
        raise not_registered(adapter_id)
    return adapter_id, owner


async def check_visible(owners: Owners, principal: Principal, raw: str) -> str:
    """The id of an existing adapter `principal` may use; else the unknown adapter's 404."""
    return (await _visible(owners, principal, raw))[0]


async def check_change(owners: Owners, principal: Principal, raw: str) -> str:
    """The id of an existing adapter `principal` may replace, pin, evict, load or delete."""
    adapter_id, owner = await _visible(owners, principal, raw)
    if owner is not None and not principal.may_change(adapter_id, owner):
        raise forbidden(f"this key may not change adapter {adapter_id!r}: "
                        + _why(principal, "change"))
    return adapter_id


async def owner_for_write(owners: Owners, principal: Principal, adapter_id: str,
                          requested: str | None) -> tuple[str, bool]:
    """(the owner an upload or registration of `adapter_id` gets: the one asked for, else its
    current one, "" shared; whether the id exists already), decided here once for the
    request; 403 if `principal` may not write there. The namespace is judged by the id alone,
    before the catalog is read, so a refusal says nothing about what exists."""
    validate_adapter_id(adapter_id)
    if requested is not None and requested != "" and not valid_tenant(requested):
        raise APIError.bad_request(f"owner {requested!r} is not a tenant name "
                                   "([a-z0-9][a-z0-9-]{0,62}; empty: shared)", param="owner")
    if principal.operator:
        if not principal.admin:
            raise forbidden("this key may not upload or register adapters")
        current = await owners.owner(adapter_id)
        return (requested if requested is not None else current or ""), current is not None
    if requested not in (None, principal.tenant):
        raise forbidden(f"a {principal.tenant!r} key may not give adapters another owner")
    if not principal.may_create(adapter_id):
        raise forbidden(f"this key may not write adapter {adapter_id!r}: "
                        + _why(principal, "write"))
    owner = await owners.owner(adapter_id)
    if owner is not None and owner != principal.tenant:
        if not principal.may_use(adapter_id, owner):
            raise not_registered(adapter_id)
        raise forbidden(f"adapter {adapter_id!r} is shared by the operator; a tenant key may "
                        "not replace it")
    return principal.tenant, owner is not None


def check_source(principal: Principal, source: str, hub_allow: list[str],
                 s3_allow: list[str]) -> None:
    """A tenant key registers only what the operator already lets any caller fetch: a Hub
    repo --hub-allow matches or an s3:// folder --s3-allow matches. A server path, or any
    other repo or bucket, would be read with the server's own files and credentials (another
    tenant's stored bytes, the operator's private repos): 403."""
    if principal.operator:
        return
    try:
        parsed = parse_source(source, allow_local=False)
    except (InvalidSource, AdapterNotFound):
        parsed = None
    allowed = parsed is not None and (
        (parsed.kind == "hub" and hub_allowed(parsed.repo_id, hub_allow))
        or (parsed.kind == "s3" and s3_allowed(source, s3_allow)))
    if not allowed:
        raise forbidden("a tenant key registers only Hub repos --hub-allow matches and s3:// "
                        "folders --s3-allow matches; upload other adapters "
                        "(POST /admin/adapters, multipart)")


def _why(principal: Principal, verb: str) -> str:
    if not principal.admin:
        return "a member key serves requests only"
    globs = f" matching {list(principal.adapters)}" if principal.adapters else ""
    return f"a {principal.tenant!r} admin key may {verb} only {principal.tenant}/...{globs}"
