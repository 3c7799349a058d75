"""Pythonic tool calls (vLLM's `pythonic`): a Python list of calls with keyword arguments,

    [get_weather(city="Paris"), add(a=1, b=-2.5, tags=["x"], strict=True)]

at the start of the output (Llama 3.2 and Gemma 3 with vLLM's pythonic templates), or wrapped in
<|python_start|> ... <|python_end|> anywhere (Llama 4). The list is parsed with `ast` and never
evaluated: arguments must be literals (strings, numbers, True/False/None, lists, tuples, dicts
with string keys); the JSON spellings true/false/null are accepted too, since Gemma's template
renders earlier calls' values with tojson. A positional argument, a call on anything but a
plain name, or any other expression makes the list content, verbatim. Text after the list is
content (vLLM's non-streamed reader makes the whole output content then; its stream does not).
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass

import regex

from loragw.engine.chat.call_stream import RawCall, Read, Start, SyntaxToolParser
from loragw.engine.chat.json_calls import marker_start, skip_space
from loragw.engine.chat.scan import python_list_end
from loragw.engine.chat.tool_calls import ToolSpec, openai_call_id

LIST_HEAD = regex.compile(r"\[\s*[A-Za-z_][A-Za-z0-9_]*\s*\(")
JSON_NAMES = {"true": True, "false": False, "null": None}


class NotLiteral(ValueError):
    pass


def literal(node: ast.expr) -> object:
    """The value a literal argument writes; NotLiteral for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | None):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise NotLiteral("a non-finite number has no JSON form")
        return node.value
    if isinstance(node, ast.Name) and node.id in JSON_NAMES:
        return JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise NotLiteral("a sign on something other than a number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List | ast.Tuple):
        return [literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        keys = [literal(k) if k is not None else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise NotLiteral("dict keys must be strings")
        return {k: literal(v) for k, v in zip(keys, node.values)}
    raise NotLiteral(ast.dump(node)[:60])


def call_list(source: str) -> list[RawCall] | None:
    """The calls of a Python list of calls; None when `source` is not one."""
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(k.arg is not None for k in node.keywords)):
            return None
        try:
            arguments = {k.arg: literal(k.value) for k in node.keywords}
        except NotLiteral:
            return None
        calls.append(RawCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return calls


@dataclass(frozen=True, slots=True)
class PythonicSyntax:
    markers: tuple[str, ...] = ("<|python_start|>", "[")
    close: str = "<|python_end|>"
    reads: tuple[str, ...] = ("<|python_start|>", "<|python_end|>")

    def find_start(self, text: str, at_output_start: bool, after_call: bool) -> Start | None:
        if at_output_start:
            lead = skip_space(text, 0)
            if m := LIST_HEAD.match(text, lead, partial=True):
                return Start(lead, not m.partial)
        return marker_start(text, self.markers[:1])

    def read(self, text: str, at: int, final: bool) -> Read:
        wrapped = text.startswith(self.markers[0], at)
        pos = skip_space(text, at + len(self.markers[0])) if wrapped else at
        if pos == len(text):
            return Read.more()
        if text[pos] != "[":
            return Read.malformed(pos)
        end = python_list_end(text, pos)
        if end is None:
            return Read.more()
        calls = call_list(text[pos:end])
        if calls is None:
            return Read.malformed(end)
        if wrapped:  # take the closing <|python_end|> with the list
            after = skip_space(text, end)
            rest = text[after:]
            if self.close.startswith(rest) and len(rest) < len(self.close) and not final:
                return Read.more()
            if rest.startswith(self.close):
                end = after + len(self.close)
        return Read.of(calls, end)


def pythonic(tools: tuple[ToolSpec, ...] = ()) -> SyntaxToolParser:
    return SyntaxToolParser("pythonic", PythonicSyntax(), True, openai_call_id)
