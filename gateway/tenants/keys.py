"""The nouns of tenancy: a tenant's API key as stored (`KeyRecord`), the caller a request
resolved to (`Principal`), and the rules of who may use and manage which adapter.

A key is `lgw-` + 43 url-safe characters (256 random bits), shown once when it is minted; only
its sha256 is stored (the secret has full entropy, so a plain hash resists guessing as well as a
slow one, and costs a microsecond per request). A rotated key keeps its previous hash until
`old_until`. Rules, as DESIGN.md "Tenants" states them:

    use      the operator's keys: everything. A tenant key: the base model, shared adapters
             (owner ""), and its tenant's adapters matching its `adapters` globs (none: all).
    manage   the operator: everything. A tenant admin: ids under `TENANT/` it may use, or new
             ones there; a member: nothing.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import secrets
import time
from dataclasses import dataclass

from loragw.gateway.tenants.windows import Limits

ROLES = ("admin", "member")
KEY_PREFIX = "lgw-"
TENANT_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
MAX_GLOBS, MAX_GLOB_LEN = 64, 256
OPERATOR_ID, API_KEY_ID, OPEN_ID = "operator", "api-key", "anonymous"


def digest(key: str) -> str:
    """What the store keeps of a key: its sha256, hex."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def new_key_id() -> str:
    return "key_" + secrets.token_hex(8)


def valid_tenant(name: str) -> bool:
    return bool(TENANT_NAME.fullmatch(name))


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One tenant key as the store keeps it (never its secret)."""

    id: str
    tenant: str
    role: str  # "admin" | "member"
    adapters: tuple[str, ...]  # globs over adapter ids; () = every adapter of its tenant
    rpm: int | None
    tpm: int | None
    max_concurrency: int | None
    created: int  # unix time
    hash: str  # digest() of the current secret
    old_hash: str = ""  # the secret before the last rotation, valid until old_until
    old_until: float = 0.0

    @property
    def limits(self) -> Limits:
        return Limits(self.rpm, self.tpm, self.max_concurrency)

    def hashes(self, now: float | None = None) -> tuple[str, ...]:
        """The digests that open this key now."""
        now = time.time() if now is None else now
        return (self.hash, self.old_hash) if self.old_hash and now < self.old_until \
            else (self.hash,)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request acts as. `tenant` None: the operator's rights (its static keys, or an open
    server); "": an anonymous caller on an open /v1 of a keyed server (shared adapters only);
    `key_id` names the key in audits and limits."""

    key_id: str
    tenant: str | None
    role: str
    adapters: tuple[str, ...] = ()
    limits: Limits = Limits()

    @property
    def operator(self) -> bool:
        return self.tenant is None

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    @property
    def metrics_label(self) -> str:
        """The `tenant` label of per-tenant metrics (bounded: tenants, never keys)."""
        return self.tenant if self.tenant else OPERATOR_ID if self.tenant is None else OPEN_ID

    @classmethod
    def of(cls, record: KeyRecord) -> Principal:
        return cls(record.id, record.tenant, record.role, record.adapters, record.limits)

    def may_use(self, adapter_id: str, owner: str) -> bool:
        """May this caller send requests to `adapter_id` (whose catalog owner is `owner`)?"""
        if self.tenant is None or not owner:
            return True
        return owner == self.tenant and self._matches(adapter_id)

    def may_create(self, adapter_id: str) -> bool:
        """May this caller put a new adapter at `adapter_id` (one no catalog entry holds)?"""
        if not self.admin:
            return False
        if self.tenant is None:
            return True
        return adapter_id.startswith(self.tenant + "/") and self._matches(adapter_id)

    def may_change(self, adapter_id: str, owner: str) -> bool:
        """May this caller replace, pin, evict or delete the existing `adapter_id`?"""
        if not self.admin:
            return False
        return self.tenant is None or (owner == self.tenant and self.may_create(adapter_id))

    def _matches(self, adapter_id: str) -> bool:
        return not self.adapters or any(fnmatch.fnmatchcase(adapter_id, g) for g in self.adapters)


OPERATOR = Principal(OPERATOR_ID, None, "admin")


def check_globs(globs: list[str], tenant: str) -> tuple[str, ...]:
    """A key's adapter globs (fnmatch, case-sensitive, over whole ids); ValueError naming a bad
    one. They narrow the key's own tenant's adapters (shared ones stay usable), so each names
    ids under `TENANT/` only: `TENANT/` then a NAME pattern, no further `/`, `\\` or `..`."""
    if len(globs) > MAX_GLOBS:
        raise ValueError(f"at most {MAX_GLOBS} adapter globs per key, got {len(globs)}")
    for glob in globs:
        if not glob or len(glob) > MAX_GLOB_LEN or not glob.isascii() or not glob.isprintable():
            raise ValueError(f"adapter glob {glob[:MAX_GLOB_LEN]!r} must be 1 to {MAX_GLOB_LEN} "
                             "printable ASCII characters")
        name = glob.removeprefix(f"{tenant}/")
        if name == glob or not name or "/" in name or "\\" in name or ".." in name:
            raise ValueError(f"adapter glob {glob!r} must name ids in tenant {tenant!r}'s "
                             f"namespace: {tenant}/ then a name pattern (no '/', '\\' or '..')")
        _check_brackets(glob)
    return tuple(globs)


def _check_brackets(glob: str) -> None:
    """fnmatch reads an unclosed `[` as a literal, silently; a key's glob means a set there."""
    i = 0
    while i < len(glob):
        if glob[i] == "[":
            j = i + 1 + (glob[i + 1:i + 2] == "!")
            j += glob[j:j + 1] == "]"  # a leading ']' is a member, not the end
            end = glob.find("]", j)
            if end < 0:
                raise ValueError(f"adapter glob {glob!r} has a '[' with no closing ']'")
            i = end
        i += 1
    try:
        re.compile(fnmatch.translate(glob))
    except re.error as exc:
        raise ValueError(f"adapter glob {glob!r} does not compile: {exc}") from None
