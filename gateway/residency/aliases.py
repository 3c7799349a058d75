"""The admin verbs on aliases (adapters/aliases.py): read, list, put and delete, each judged by
the tenant rules of DESIGN.md "Tenants" as adapters are:

    see       an alias a key may use (`Principal.may_use(alias, owner)`) whose every target it
              may use too (`usable`); any other is the unknown alias's 404, on the admin
              routes and on /v1 alike, so neither the alias nor what it points at leaks. A
              target the catalog does not list (deleted with ?force=true) is seen by the
              alias's tenant and the operator only; one fetched on demand (--hub-allow,
              --s3-allow) by anyone, as /v1 serves it
    serve     `locate_model`: the target drawn once, located; a 404 on the way names the alias
              the client sent, never its target
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
from loragw.gateway.common.records import Location
from loragw.gateway.residency.manager import AdapterManager
from loragw.gateway.residency.names import on_demand
from loragw.gateway.tenants.access import forbidden
from loragw.gateway.tenants.keys import Principal, valid_tenant


def alias_not_found(name: str) -> APIError:
    """The 404 for an unknown alias, and for one the caller may not use."""
    return APIError(404, f"alias {name[:200]!r} does not exist; GET /admin/aliases lists the "
                         "aliases this key may use", code="alias_not_found")


def usable(manager: AdapterManager, caller: Principal, alias: Alias) -> bool:
    """May `caller` see and use `alias`: the alias itself and each of its targets, judged by
    the catalog as this replica holds it (no I/O: the request path calls it)."""
    if not caller.may_use(alias.alias, alias.owner):
        return False
    for target in alias.targets:
        adapter_id, source = on_demand(target_id(target.adapter), manager.hub_allow,
                                       manager.s3_allow)
        record = manager.records.get(adapter_id)
        if record is not None:
            if not caller.may_use(adapter_id, record.entry.owner):
                return False
        elif source is None and not (caller.operator or caller.tenant == alias.owner):
            return False  # dangling: its name is the alias tenant's business only
    return True


async def locate_model(manager: AdapterManager, caller: Principal, model: str,
                       user: str | None = None, chosen: str | None = None) -> tuple[str, Location]:
    """(the name served, where): `model`, or the target of the alias `model` names, drawn
    once (`chosen`: a forwarding replica's draw). A 404 names `model` as the client sent it."""
    target = manager.aliases.resolve(model, user, lambda a: usable(manager, caller, a),
                                     chosen=chosen)
    try:
        return target, await manager.locate(target, caller)
    except (APIError, AdapterError) as exc:
        if target == model or exc.status != 404:
            raise
        raise APIError.model_not_found(model) from None


async def visible(manager: AdapterManager, caller: Principal, name: str) -> Alias:
    """The alias `name`, if the caller may use it; else the unknown alias's 404 (an invalid
    name too: it names no alias)."""
    await manager.aliases.sync()
    alias = manager.aliases.get(name)
    if alias is None or not usable(manager, caller, alias):
        raise alias_not_found(name)
    return alias


async def listed(manager: AdapterManager, caller: Principal) -> list[Alias]:
    await manager.aliases.sync()
    return [a for a in manager.aliases.all() if usable(manager, caller, a)]


async def targeting(manager: AdapterManager, adapter_id: str, caller: Principal,
                    force: bool) -> None:
    """Before deleting `adapter_id`: 409 naming the aliases that point at it (those the
    caller may see; the others counted), unless `force`."""
    await manager.aliases.sync()
    found = [a for a in manager.aliases.all()
             if any(target_id(t.adapter) == adapter_id for t in a.targets)]
    if not found or force:
        return
    named = [a.alias for a in found if usable(manager, caller, a)]
    hidden = len(found) - len(named)
    listed_names = ", ".join(repr(n) for n in named[:8]) + (" ..." if len(named) > 8 else "")
    others = f"{' and ' if named else ''}{hidden} alias(es) this key cannot see" if hidden else ""
    raise AliasConflict(f"adapter {adapter_id!r} is a target of {listed_names}{others}; "
                        "point them elsewhere (PUT /admin/aliases/NAME) first, or delete with "
                        "?force=true to leave them dangling (their requests then get 404)")


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
