"""A forced tool call (tool_choice required, or named) constrained to the served model's own call
syntax, so the parser that reads its answers (engine/chat/) reads the forced one too:

    hermes          <tool_call>{"name": N, "arguments": {...}}</tool_call>
    llama3_json     {"name": N, "parameters": {...}}
    mistral         [TOOL_CALLS][{"name": N, "arguments": {...}}]     (v0.3 tokenizers)
                    [TOOL_CALLS]N[ARGS]{...}                          (with an [ARGS] token)
    phi4_mini_json  functools[{"name": N, "arguments": {...}}]
    pythonic        [N(a=1, b="x")]                                   (literal arguments)
    qwen3_coder     <tool_call>\\n<function=N>\\n<parameter=P>\\nV\\n</parameter>\\n...</function>
                    \\n</tool_call>
    (no parser)     {"name": N, "arguments": {...}}, read as llama3_json reads it

One call of the allowed tools; its arguments follow each tool's parameters schema where the
syntax writes JSON, with no newline around it (a JSON-only output's tokens are kept free of
control bytes, engine/request/structured.py) (a GuidedDecoding of kind "syntax": parts in a row, one alternative per
syntax or per tool).
"""

from __future__ import annotations

import re
from typing import Any

from loragw.engine.api import GuidedDecoding
from loragw.gateway.openai.tool_calls import tool_call_schema

GENERIC = "llama3_json"  # what reads the generic {"name", "arguments"} object
# pythonic: one literal argument value (strings, numbers, booleans, None; no nesting)
_LITERAL = r'(?:"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|-?\d+(?:\.\d+)?|True|False|None)'
_KEYWORD = r"[A-Za-z_][A-Za-z0-9_]*=" + _LITERAL


def forced_call(syntax: str | None, tools: list[dict[str, Any]], names: list[str],
                args_token: bool = False) -> tuple[GuidedDecoding, str]:
    """(the constraint of one call of `names`, the parser that reads it) in `syntax` (the
    served model's tool-call parser; None: the generic JSON object). `args_token`: the
    tokenizer has Mistral's [ARGS] (the newer, per-call syntax)."""
    call = tool_call_schema(tools, names)
    params = {t["function"]["name"]: t["function"].get("parameters")
              or {"type": "object", "properties": {}} for t in tools}
    if syntax == "hermes":
        return _parts([[("text", "<tool_call>"), ("json_schema", call),
                        ("text", "</tool_call>")]]), syntax
    if syntax == "llama3_json":
        renamed = [{"type": "object", "properties": {"name": {"const": n},
                                                     "parameters": params[n]},
                    "required": ["name", "parameters"], "additionalProperties": False}
                   for n in names]
        schema = renamed[0] if len(renamed) == 1 else {"anyOf": renamed}
        return GuidedDecoding("json_schema", schema), syntax
    if syntax == "mistral" and args_token:
        return _parts([[("text", f"[TOOL_CALLS]{n}[ARGS]"), ("json_schema", params[n])]
                       for n in names]), syntax
    if syntax == "mistral":
        return _parts([[("text", "[TOOL_CALLS]["), ("json_schema", call), ("text", "]")]]), syntax
    if syntax == "phi4_mini_json":
        return _parts([[("text", "functools["), ("json_schema", call), ("text", "]")]]), syntax
    if syntax == "pythonic":
        arguments = f"(?:{_KEYWORD}(?:, {_KEYWORD})*)?"
        return _parts([[("regex", rf"\[{re.escape(n)}\({arguments}\)\]")] for n in names]), syntax
    if syntax == "qwen3_coder":
        return _parts([[("regex", _qwen3_coder(n, params[n]))] for n in names]), syntax
    return GuidedDecoding("json_schema", call), GENERIC


def _parts(alternatives: list[list[tuple[str, Any]]]) -> GuidedDecoding:
    return GuidedDecoding("syntax", [[list(p) for p in alt] for alt in alternatives])


def _qwen3_coder(name: str, schema: dict[str, Any]) -> str:
    """<function=N> with zero or more of its declared parameters, each value one line."""
    properties = list(schema.get("properties") or {})
    parameter = (r"(?:<parameter=(?:" + "|".join(map(re.escape, properties)) +
                 r")>\n[^<\n]*\n</parameter>\n)*") if properties else ""
    return rf"<tool_call>\n<function={re.escape(name)}>\n{parameter}</function>\n</tool_call>"
