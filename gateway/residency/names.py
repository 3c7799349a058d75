"""What a request's `model` names: the base model, an adapter id, or a Hub / s3:// adapter
fetched on first use when --hub-allow / --s3-allow say so; where it can be served; and which
ids a registration may take."""

from __future__ import annotations

from collections.abc import Mapping

from loragw.adapters.errors import AdapterNotFound
from loragw.adapters.ids import validate_adapter_id
from loragw.adapters.sources import (
    HUB_SCHEME,
    InvalidSource,
    hub_allowed,
    parse_source,
    s3_adapter_id,
    s3_allowed,
)
from loragw.adapters.store import AdapterExists
from loragw.gateway.common.errors import APIError
from loragw.gateway.common.records import AdapterRecord


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


def check_new_id(adapter_id: str, base_name: str) -> None:
    """An id a registration may take: a safe one (adapters.ids), not the base model's name."""
    validate_adapter_id(adapter_id)
    if adapter_id == base_name:
        raise APIError.bad_request(f"{adapter_id!r} is the base model's name; pick another "
                                   "adapter id", param="adapter_id")


def check_free(records: Mapping[str, AdapterRecord], adapter_id: str, replace: bool,
               conflict: int) -> None:
    """A taken id is refused unless the caller replaces it: 409, or vLLM's 400 (`conflict`)."""
    if adapter_id in records and not replace:
        if conflict == 400:
            raise APIError.bad_request(
                f"adapter {adapter_id!r} is already loaded; unload it first or pass "
                "load_inplace=true to replace it", param="lora_name", code="adapter_exists")
        raise AdapterExists(f"adapter {adapter_id!r} already exists (version "
                            f"{records[adapter_id].entry.version}); pass replace=true "
                            "to replace it or delete it first")
