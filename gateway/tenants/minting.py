"""The rules a tenant key's mint, rotation and revocation obey (DESIGN.md "Tenants"):

    who       the operator, or an admin key of that tenant (403 otherwise, and for a member)
    role      "admin" | "member"
    limits    positive; a tenant admin mints nothing looser than itself: a limit it has is the
              new key's ceiling and default, and its adapter globs bound the new key's
    open      a server without --admin-key or --api-key has no tenants to protect: minting
              there is refused (403), so keys never give a false sense of isolation
    grace     a rotated key's old secret works for at most MAX_GRACE_S more
"""

from __future__ import annotations

from loragw.gateway.common.config import ServerConfig
from loragw.gateway.common.errors import APIError
from loragw.gateway.tenants.access import forbidden
from loragw.gateway.tenants.keys import ROLES, Principal, check_globs, valid_tenant
from loragw.gateway.tenants.windows import Limits

MAX_GRACE_S = 30 * 24 * 3600
# Far above any real key's, well inside what Redis's Lua (doubles) counts exactly.
MAX_RPM, MAX_TPM, MAX_CONCURRENCY = 10**9, 10**12, 10**6


def check_manager(caller: Principal, tenant: str, config: ServerConfig) -> None:
    """`caller` may manage `tenant`'s keys, on a server that has tenants to protect."""
    if not caller.operator and caller.tenant != tenant:
        raise forbidden(f"this key may manage only tenant {caller.tenant!r}'s keys")
    if not valid_tenant(tenant):
        raise APIError.bad_request(f"tenant {tenant[:70]!r} is not a tenant name: "
                                   "[a-z0-9][a-z0-9-]{0,62}", param="tenant")
    if config.admin_key is None and config.api_key is None:
        raise forbidden("this server runs without --admin-key: every caller is the operator, "
                        "so tenant keys would protect nothing; restart with --admin-key")


def check_role(role: str) -> str:
    if role not in ROLES:
        raise APIError.bad_request(f"role must be one of {list(ROLES)}, got {role!r}",
                                   param="role")
    return role


def check_grace(grace: int) -> int:
    if not 0 <= grace <= MAX_GRACE_S:
        raise APIError.bad_request(f"grace_seconds must be in [0, {MAX_GRACE_S}], got "
                                   f"{grace}", param="grace_seconds")
    return grace


def new_key_limits(caller: Principal, asked: dict[str, int | None]) -> Limits:
    """The new key's limits ({"rpm": .., "tpm": .., "max_concurrency": ..} as asked, None:
    none asked), bounded by the caller's own."""
    values = {}
    for name in ("rpm", "tpm", "max_concurrency"):
        wanted, ceiling = asked[name], getattr(caller.limits, name)
        if wanted is not None and wanted < 1:
            raise APIError.bad_request(f"{name} must be at least 1, got {wanted} (leave it out "
                                       "for no limit)", param=name)
        if ceiling is not None and (wanted is None or wanted > ceiling):
            if wanted is not None:
                raise forbidden(f"{name} {wanted} is above this key's own {name} {ceiling}")
            wanted = ceiling
        values[name] = wanted
    return Limits(**values)


def new_key_globs(caller: Principal, tenant: str, asked: list[str] | None) -> tuple[str, ...]:
    """The new key's adapter globs, in `tenant`'s namespace and within the caller's own."""
    try:
        globs = check_globs(asked or [], tenant)
    except ValueError as exc:
        raise APIError.bad_request(str(exc), param="adapters") from None
    if caller.adapters and not globs:
        return caller.adapters
    if caller.adapters and not set(globs) <= set(caller.adapters):
        raise forbidden(f"adapters {sorted(set(globs) - set(caller.adapters))} are outside "
                        f"this key's own {list(caller.adapters)}")
    return globs
