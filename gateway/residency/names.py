"""What a request's `model` names: the base model, an adapter id, or a Hub / s3:// adapter
fetched on first use when --hub-allow / --s3-allow say so; and where it can be served."""

from __future__ import annotations

from dataclasses import dataclass

from adapters.errors import AdapterNotFound
from adapters.sources import (
    HUB_SCHEME,
    InvalidSource,
    hub_allowed,
    parse_source,
    s3_adapter_id,
    s3_allowed,
)


@dataclass(frozen=True, slots=True)
class Location:
    """Where a request's model can be served."""

    adapter_id: str | None  # None: the base model
    here: bool  # this replica holds it or can fetch it
    # replicas to forward to first, best first: the only ones that hold it (not `here`), or
    # those that hold it while the store it is fetched from does not answer (`here`)
    holders: tuple[str, ...] = ()
    source: str | None = None  # a new Hub or s3:// adapter to fetch on demand


def on_demand(model: str, hub_allow: list[str], s3_allow: list[str]) -> tuple[str, str | None]:
    """(adapter id, source to fetch it from if it is new) for a model name: ORG/REPO or
    hf://ORG/REPO allowed by --hub-allow, s3://BUCKET/PATH allowed by --s3-allow; any
    other name is its own id, with nothing to fetch."""
    try:
        if model.startswith("s3://") and s3_allowed(model, s3_allow):
            parsed = parse_source(model, allow_local=False)
            return s3_adapter_id(parsed.bucket, parsed.key), parsed.uri
        if hub_allow and "@" not in model:
            parsed = parse_source(model, allow_local=False)
            if parsed.kind == "hub" and hub_allowed(parsed.repo_id, hub_allow):
                return parsed.repo_id, HUB_SCHEME + parsed.repo_id
    except (InvalidSource, AdapterNotFound):
        pass
    return model, None
