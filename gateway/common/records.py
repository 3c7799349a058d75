"""The residency nouns several wings share: where a request's model is served (`Location`), a
catalog adapter as this replica knows it (`AdapterRecord`), and the 404 for an adapter that is
not there (or that a key may not see). Residency fills them; admission, tenants, tracing and
the admin routes read them."""

from __future__ import annotations

from dataclasses import dataclass

from loragw.adapters.errors import AdapterNotFound, short_name
from loragw.adapters.registry import CatalogEntry
from loragw.adapters.store_meta import StoredAdapter


@dataclass(frozen=True, slots=True)
class Location:
    """Where a request's model can be served."""

    adapter_id: str | None  # None: the base model
    here: bool  # this replica holds it or can fetch it
    # replicas to forward to first, best first: the only ones that hold it (not `here`), or
    # those that hold it while the store it is fetched from does not answer (`here`)
    holders: tuple[str, ...] = ()
    source: str | None = None  # a new Hub or s3:// adapter to fetch on demand
    version: int | None = None  # the catalog version that serves it (None: base, or not known)
    older: bool = False  # an earlier version a request pinned (ID@N), not the id's newest

    @property
    def engine_adapter(self) -> str | None:
        """The name the engine serves it under: the id, or ID@N for an earlier version."""
        return f"{self.adapter_id}@{self.version}" if self.older else self.adapter_id


def not_registered(adapter_id: str) -> AdapterNotFound:
    """The 404 for an unknown adapter id (and, to a tenant key, for one it may not use)."""
    return AdapterNotFound(f"adapter {short_name(adapter_id)} is not registered; GET "
                           "/admin/adapters lists the registered ones")


@dataclass(slots=True)
class AdapterRecord:
    """A catalog adapter as this replica knows it: the catalog's entry, its copy on this disk
    (None: remote, fetched on first use), and whether the engine knows it yet."""

    entry: CatalogEntry
    stored: StoredAdapter | None = None
    # registered in the engine (parsed once; after a host eviction the engine re-reads it from
    # its disk copy itself); False: never handed to the engine yet (on disk only, or remote)
    in_engine: bool = False
    pinned: bool = False

    @property
    def name(self) -> str:
        return self.entry.adapter_id

    @property
    def source(self) -> str:
        return self.entry.source

    @property
    def created(self) -> int:
        return int(self.entry.created_at)
