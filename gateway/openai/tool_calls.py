"""A forced tool call's constraint (tool_choice required or named): the JSON schema of one call
{"name": n, "arguments": <n's parameters>} of the allowed tools. The answers themselves are read
by the served model's tool-call parser (engine/chat/, gateway/openai/chat_reading.py)."""

from __future__ import annotations

from typing import Any


def tool_call_schema(tools: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """JSON schema of one call {"name": n, "arguments": <n's parameters>} of the allowed tools."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    calls = []
    for name in names:
        params = by_name[name].get("parameters") or {"type": "object", "properties": {}}
        calls.append({"type": "object", "properties": {"name": {"const": name},
                                                       "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False})
    return calls[0] if len(calls) == 1 else {"anyOf": calls}
