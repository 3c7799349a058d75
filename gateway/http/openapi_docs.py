"""What the OpenAPI document (GET /schema/openapi.json) says beyond what Litestar derives from
the types: ranges that include 0, list items' ranges, checks a handler makes (`openapi`), the
generation routes' second media type (server-sent events) and the adapter upload's multipart
body. The errors every route answers are `error_handlers.error_responses`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.openapi.spec import (
    OpenAPIFormat,
    OpenAPIMediaType,
    OpenAPIType,
    Operation,
    RequestBody,
    Schema,
)
from litestar.params import Parameter

from loragw.adapters.ids import ADAPTER_ID_PATTERN, MAX_ADAPTER_ID_LEN
from loragw.gateway.residency.versions import PIN_PATTERN
from loragw.gateway.tenants.keys import ROLES, TENANT_NAME

_SCHEMA_NAMES = {"ge": "minimum", "gt": "exclusive_minimum", "le": "maximum",
                 "lt": "exclusive_maximum"}
# protocol.TokenId inside a list (whose items Litestar documents without their bounds)
TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}


def openapi(**schema: Any) -> dict[str, Any]:
    """`Meta(extra_json_schema=...)` that Litestar copies into the field's OpenAPI schema
    (Schema attribute names: `one_of`, `additional_properties`, ...)."""
    return {"extra": schema}


# Names the handlers check (with messages naming the rule), stated for the document's readers
# and generators: Schema attribute names.
ADAPTER_ID = {"pattern": f"^{ADAPTER_ID_PATTERN}$", "max_length": MAX_ADAPTER_ID_LEN}
ADAPTER_TARGET = {"pattern": f"^{ADAPTER_ID_PATTERN}({PIN_PATTERN})?$"}  # ID, ID@N, ID@sha256:..
TENANT = {"pattern": f"^{TENANT_NAME.pattern}$"}
OWNER = {"pattern": f"^({TENANT_NAME.pattern})?$"}  # a tenant, or "": shared
ROLE = {"enum": list(ROLES)}


def adapter_action(actions: tuple[str, ...]) -> dict[str, Any]:
    """`ID/ACTION`: the admin action routes' path (POST /admin/adapters/bot/load)."""
    return {"pattern": f"^{ADAPTER_ID_PATTERN}/({'|'.join(actions)})$"}


def documented(schema: dict[str, Any]) -> msgspec.Meta:
    """A Struct field's Meta stating `schema` (one of the above) in the document only."""
    return msgspec.Meta(extra_json_schema=openapi(**schema))


def path_parameter(schema: dict[str, Any]) -> Any:
    """A path parameter stating `schema` in the document only (its handler checks it)."""
    return Parameter(schema_extra=schema)


def bounds(**limits: float) -> msgspec.Meta:
    """A range that decoding enforces and the OpenAPI document states: restated as schema
    extra, since Litestar drops a bound of 0 (it tests the bound's truth)."""
    return msgspec.Meta(**limits, extra_json_schema=openapi(
        **{_SCHEMA_NAMES[k]: v for k, v in limits.items()}))


def inlined(struct: type) -> dict[str, Any]:
    """msgspec's JSON schema of `struct`, each `$ref` replaced by its definition (these Structs
    do not recurse): self-contained, for a schema Litestar does not register."""
    schema = msgspec.json.schema(struct)
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(defs[node["$ref"].rpartition("/")[2]])
            return {key: resolve(value) for key, value in node.items()}
        return [resolve(item) for item in node] if isinstance(node, list) else node

    return resolve(schema)


def streamed(*payloads: type, done: bool = True) -> type[Operation]:
    """The operation of a route whose 200 is JSON, or with stream=true server-sent events,
    each event's data one of `payloads` as JSON (an error, too, once the headers are gone) and,
    with `done`, the last one `[DONE]`. It documents both media types."""
    data = Schema(type=OpenAPIType.STRING, content_media_type="application/json",
                  content_schema={"anyOf": [inlined(p) for p in payloads]})
    if done:
        data = Schema(any_of=[Schema(type=OpenAPIType.STRING, const="[DONE]"), data])
    event = Schema(type=OpenAPIType.OBJECT, required=["data"], properties={"data": data})
    names = " | ".join(p.__name__ for p in payloads)

    @dataclass
    class Streamed(Operation):
        def __post_init__(self) -> None:
            ok = self.responses["200"]
            ok.description += (f"; with stream=true, `data: {{{names}}}` events"
                               + (", then `data: [DONE]`" if done else ""))
            ok.content["text/event-stream"] = OpenAPIMediaType(schema=event)

    return Streamed


@dataclass
class OptionalBody(Operation):
    """A route whose body may be left out (`data: X | None = None`), which Litestar documents
    as required."""

    def __post_init__(self) -> None:
        if self.request_body is not None:
            self.request_body.required = False


@dataclass
class MultipartUpload(Operation):
    """The adapter upload's multipart body, which its handler reads itself (size first)."""

    def __post_init__(self) -> None:
        def part(what: str, binary: bool = False, **rule: Any) -> Schema:
            return Schema(type=OpenAPIType.STRING, description=what,
                          format=OpenAPIFormat.BINARY if binary else None, **rule)

        form = Schema(type=OpenAPIType.OBJECT, properties={
            "adapter_id": part("the new adapter's id: NAME or ORG/NAME", **ADAPTER_ID),
            "adapter_config": part("adapter_config.json", binary=True),
            "adapter_model": part("adapter_model.safetensors", binary=True),
            "replace": part("true to replace an adapter of this id"),
            "owner": part("the operator's: the tenant it belongs to (empty: shared)", **OWNER),
            "draft_adapter": part("the source of its draft-model LoRA (speculative decoding "
                                  "with a draft model): a directory, hf://ORG/REPO or s3://"),
            "chat_template": part("its own chat template (Jinja), where it does not speak as "
                                  "the base: text or chat_template.jinja"),
            "tokenizer_config": part("its tokenizer_config.json: its chat_template, and the "
                                     "tokens it adds (checked against the base's vocabulary)",
                                     binary=True),
            "generation_config": part("its generation_config.json: its sampling defaults",
                                      binary=True),
            "reasoning_parser": part("how it writes its thinking (default: the base's, or "
                                     "read from its own template); none: not parsed"),
            "tool_call_parser": part("how it writes tool calls, likewise")},
            required=["adapter_id", "adapter_config", "adapter_model"])
        self.request_body = RequestBody(required=True, content={
            "multipart/form-data": OpenAPIMediaType(schema=form)})
