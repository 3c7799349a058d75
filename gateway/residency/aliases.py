"""The admin verbs on aliases (adapters/aliases.py): read, list, put and delete, each judged by
the tenant rules of DESIGN.md "Tenants" as adapters are:

    see       an alias a key may use (`Principal.may_use(alias, owner)`); any other is the
              unknown alias's 404, on the admin routes and on /v1 alike
    put       the operator: any name (owner "" = shared, or the tenant it names); a tenant
              admin: only `TENANT/...` names its globs match (403 otherwise, judged by the name
              alone before anything is read), never an alias the operator shares there
    delete    who may put it
    targets   1..16, each `ID`, `ID@N` or `ID@sha256:HEXPREFIX` that the caller may use and
              `locate` finds now (404 naming it), none another alias (409); the alias's name
              is no adapter's id (409) and not the base model's

Every verb reads the store first, so an admin call on any replica sees the fleet's aliases now,
not as of the last heartbeat.
"""

from __future__ import annotations

import time

from loragw.adapters.aliases import (
    Alias,
    AliasConflict,
    AliasTarget,
    InvalidAlias,
    check_alias,
    target_id,
)
from loragw.adapters.errors import AdapterError
from loragw.gateway.common.errors import APIError
from loragw.gateway.residency.manager import AdapterManager
from loragw.gateway.tenants.access import forbidden
from loragw.gateway.tenants.keys import Principal, valid_tenant


def alias_not_found(name: str) -> APIError:
    """The 404 for an unknown alias, and for one the caller may not use."""
    return APIError(404, f"alias {name[:200]!r} does not exist; GET /admin/aliases lists the "
                         "aliases this key may use", code="alias_not_found")


async def visible(manager: AdapterManager, caller: Principal, name: str) -> Alias:
    """The alias `name`, if the caller may use it; else the unknown alias's 404 (an invalid
    name too: it names no alias)."""
    await manager.aliases.sync()
    alias = manager.aliases.get(name)
    if alias is None or not caller.may_use(alias.alias, alias.owner):
        raise alias_not_found(name)
    return alias


async def listed(manager: AdapterManager, caller: Principal) -> list[Alias]:
    await manager.aliases.sync()
    return [a for a in manager.aliases.all() if caller.may_use(a.alias, a.owner)]


async def put(manager: AdapterManager, caller: Principal, name: str,
              targets: list[AliasTarget], owner: str | None) -> tuple[Alias, bool]:
    """(the alias as stored, whether it existed) after the checks above; nothing changes
    unless all pass."""
    _check_namespace(caller, name, owner)
    alias = check_alias(Alias(name, tuple(targets), "", int(time.time())))
    await manager.aliases.sync()
    old = manager.aliases.get(name)
    if old is not None and not caller.operator and old.owner != caller.tenant:
        if not caller.may_use(name, old.owner):
            raise alias_not_found(name)
        raise forbidden(f"alias {name!r} is shared by the operator; a tenant key may not "
                        "change it")
    if name == manager.base_name or await manager.catalog.owner(name) is not None:
        raise AliasConflict(f"{name!r} is an adapter's id (or the base model's name); an alias "
                            "needs a name of its own")
    for i, target in enumerate(alias.targets):
        await _check_target(manager, caller, i, target.adapter)
    if caller.operator:
        owner = owner if owner is not None else (old.owner if old is not None else "")
    else:
        owner = caller.tenant
    stored = Alias(name, alias.targets, owner, alias.updated_at)
    await manager.aliases.put(stored)
    return stored, old is not None


async def delete(manager: AdapterManager, caller: Principal, name: str) -> Alias:
    alias = await visible(manager, caller, name)
    if not caller.may_change(name, alias.owner):
        raise forbidden(f"this key may not change alias {name!r}: "
                        f"a {caller.tenant!r} admin key changes only {caller.tenant}/...")
    if not await manager.aliases.delete(name):
        raise alias_not_found(name)  # deleted on another replica a moment ago
    return alias


def _check_namespace(caller: Principal, name: str, owner: str | None) -> None:
    if owner is not None and owner != "" and not valid_tenant(owner):
        raise InvalidAlias(f"owner {owner[:70]!r} is not a tenant name "
                           "([a-z0-9][a-z0-9-]{0,62}; empty: shared)")
    if caller.operator:
        return
    if owner not in (None, caller.tenant):
        raise forbidden(f"a {caller.tenant!r} key may not give aliases another owner")
    if not caller.may_create(name):
        globs = f" matching {list(caller.adapters)}" if caller.adapters else ""
        raise forbidden(f"this key may not write alias {name[:200]!r}: a {caller.tenant!r} "
                        f"admin key may write only {caller.tenant}/...{globs}")


async def _check_target(manager: AdapterManager, caller: Principal, i: int,
                        target: str) -> None:
    if manager.aliases.get(target_id(target)) is not None:
        raise AliasConflict(f"targets[{i}]: {target!r} is an alias; an alias points at "
                            "adapters only (name the adapter it points at)")
    try:
        await manager.locate(target, caller)
    except (APIError, AdapterError) as exc:
        status = getattr(exc, "status", 404)
        if status != 404:
            raise
        raise APIError(404, f"targets[{i}]: adapter {target[:200]!r} does not exist (or this "
                            "key may not use it); GET /admin/adapters lists the adapters this "
                            "key may use", param=f"targets[{i}].adapter",
                       code="model_not_found") from None
