"""Qwen3-Coder's XML tool calls (vLLM's `qwen3_coder`), anywhere in the output, several:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is the text between its tags less one leading and one trailing newline, converted by
the type the tool's JSON schema gives the parameter, as vLLM does: "null" is null whatever the
type; string (and undeclared parameters) stay text; integer and number parse as numbers (a
number with no fraction becomes an integer); object and array parse as JSON, else as a Python
literal (Qwen's template writes earlier calls' nested values with tojson); other types try a
Python literal. A value that does not convert stays text, except that vLLM turns a boolean other
than true/false into false where this keeps the text. As in vLLM, a parameter may end at the
next <parameter= or at </function> without its </parameter>, and one <tool_call> may hold
several <function=...> blocks. A block without a <function=NAME>...</function> is content.
"""

from __future__ import annotations

import ast
import functools
import json
import math
from collections.abc import Mapping

import regex

from loragw.engine.chat.call_stream import RawCall, SyntaxToolParser
from loragw.engine.chat.json_calls import TaggedSyntax, load_json
from loragw.engine.chat.tool_calls import ToolSpec, openai_call_id, tools_by_name

FUNCTION = regex.compile(r"<function=([A-Za-z0-9_.\-]+)>(.*?)</function>", regex.DOTALL)
PARAMETER = regex.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)",
                          regex.DOTALL)
TEXT_TYPES = ("string", "str", "text", "varchar", "char", "enum")
INTEGER_TYPES = ("int", "uint", "long", "short", "unsigned")


def json_ready(value: object) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def python_literal(text: str) -> object:
    """ast.literal_eval of text, or the text itself when it is no JSON-able literal."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text
    return value if json_ready(value) else text


def convert(text: str, kind: str | None) -> object:
    """A parameter's text as the value its schema type asks for (see the module docstring)."""
    if text.lower() == "null":
        return None
    kind = (kind or "string").strip().lower()
    if kind in TEXT_TYPES:
        return text
    if kind.startswith(INTEGER_TYPES):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(("num", "float")):
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):
            return text
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return {"true": True, "false": False}.get(text.strip().lower(), text)
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        value = load_json(text)
        if value is not None:
            return value
    return python_literal(text)


def function_calls(body: str, tools: Mapping[str, ToolSpec]) -> list[RawCall] | None:
    """The <function=...> blocks of one <tool_call> body; None when it holds anything else."""
    calls, last = [], 0
    for function in FUNCTION.finditer(body):
        if body[last:function.start()].strip():
            return None
        last = function.end()
        tool = tools.get(function[1])
        arguments: dict[str, object] = {}
        for parameter in PARAMETER.finditer(function[2]):
            name, value = parameter[1].strip(), parameter[2]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            arguments[name] = convert(value, tool.parameter_type(name) if tool else None)
        calls.append(RawCall(function[1], json.dumps(arguments, ensure_ascii=False)))
    return calls if calls and not body[last:].strip() else None


def qwen3_coder(tools: tuple[ToolSpec, ...] = ()) -> SyntaxToolParser:
    """`tools` give the parameters' types; without them every value stays text."""
    syntax = TaggedSyntax(functools.partial(function_calls, tools=tools_by_name(tools)))
    return SyntaxToolParser("qwen3_coder", syntax, True, openai_call_id)
