"""The tool-call syntaxes that carry each call as JSON (vLLM's parser names):

    hermes          <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>, anywhere, several
                    (Qwen2.5, Qwen3, Hermes); content before and between calls is kept
    llama3_json     {"name": "f", "parameters": {"x": 1}} at the start of the output, or after
                    <|python_tag|> anywhere; several separated by ";" (Llama 3.1 / 3.2 / 4 JSON)
    mistral         [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, ...]  (v0.3 tokenizers)
                    or [TOOL_CALLS]f[ARGS]{"x": 1}, repeated per call (v11+ tokenizers; an optional
                    [CALL_ID]... before [ARGS] is skipped); content before [TOOL_CALLS] is kept
    phi4_mini_json  functools[{"name": "f", "arguments": {"x": 1}}, ...]  (Phi-4-mini)

"arguments" and "parameters" are both accepted (a bare llama3_json object needs one of them, so
that JSON content is not taken for a call); an arguments value that is a JSON string holding an
object is read as that object; other keys (v0.3's "id") are ignored. A call whose JSON does not
parse, or is not {"name": text, "arguments": object}, is content, verbatim. An unclosed
<tool_call> at the end of the output is read as a call when its JSON is whole (as vLLM does),
else it is content. Unlike vLLM, which keeps only the text before the first call (hermes) or
none at all (llama3_json, phi4_mini_json), the text around and between calls stays content.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import regex

from loragw.engine.chat.call_stream import RawCall, Read, Start, SyntaxToolParser
from loragw.engine.chat.scan import json_end, scan_markers
from loragw.engine.chat.tool_calls import ToolSpec, mistral_call_id, openai_call_id


def marker_start(text: str, markers: tuple[str, ...]) -> Start | None:
    """The first of `markers` in text (sure), or a tail that may become one (not sure)."""
    found = scan_markers(text, markers)
    if found.marker is not None:
        return Start(found.at, True)
    return Start(found.at, False) if found.at < len(text) else None


def read_tagged(text: str, body: int, close: str, final: bool,
                calls: Callable[[str], list[RawCall] | None]) -> Read:
    """The calls `calls` reads in text[body:] up to the closing tag `close` (or the end of a
    final text without one); more text needed while neither has come."""
    end_tag = text.find(close, body)
    if end_tag < 0 and not final:
        return Read.more()
    end = len(text) if end_tag < 0 else end_tag + len(close)
    read = calls(text[body:end_tag if end_tag >= 0 else len(text)])
    return Read.of(read, end) if read else Read.malformed(end)


def skip_space(text: str, pos: int) -> int:
    return len(text) - len(text[pos:].lstrip())


def json_call(value: object, require_arguments: bool) -> RawCall | None:
    """{"name": text, "arguments" | "parameters": object} as a call; None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    keys = [k for k in ("arguments", "parameters") if k in value]
    if len(keys) > 1 or (require_arguments and not keys):
        return None
    arguments = value[keys[0]] if keys else {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return RawCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def load_json(text: str) -> object:
    """json.loads, None for text that is no JSON (NaN and Infinity included)."""
    def refuse(name: str) -> object:
        raise ValueError(name)
    try:
        return json.loads(text, parse_constant=refuse)
    except ValueError:
        return None


def json_calls(value: object, require_arguments: bool) -> list[RawCall] | None:
    """A non-empty JSON array of calls; None if it is not one, or one item is no call."""
    if not isinstance(value, list) or not value:
        return None
    calls = [json_call(item, require_arguments) for item in value]
    read = [c for c in calls if c is not None]
    return read if len(read) == len(calls) else None


@dataclass(frozen=True, slots=True)
class TaggedSyntax:
    """Calls each in <tool_call>...</tool_call>, the body read by `parse` (Hermes' JSON object,
    Qwen3-Coder's <function=...> block)."""

    parse: Callable[[str], list[RawCall] | None]
    markers: tuple[str, ...] = ("<tool_call>",)
    close: str = "</tool_call>"
    reads: tuple[str, ...] = ("<tool_call>", "</tool_call>")

    def find_start(self, text: str, at_output_start: bool, after_call: bool) -> Start | None:
        return marker_start(text, self.markers)

    def read(self, text: str, at: int, final: bool) -> Read:
        return read_tagged(text, at + len(self.markers[0]), self.close, final, self.parse)


def hermes_body(body: str) -> list[RawCall] | None:
    call = json_call(load_json(body), False)
    return [call] if call else None


# A bare call's first key; after a call, ";" and the next one.
_HEAD = r'\{\s*"(?:name|type|parameters|arguments)"\s*:'
LLAMA_HEAD = regex.compile(_HEAD)
LLAMA_NEXT = regex.compile(r"\s*;\s*" + _HEAD)


@dataclass(frozen=True, slots=True)
class Llama3JsonSyntax:
    markers: tuple[str, ...] = ("<|python_tag|>", "{")
    reads: tuple[str, ...] = ("<|python_tag|>",)

    def find_start(self, text: str, at_output_start: bool, after_call: bool) -> Start | None:
        if after_call and (m := LLAMA_NEXT.match(text, partial=True)):
            return Start(skip_space(text, 0), not m.partial)
        if at_output_start:
            lead = skip_space(text, 0)
            if m := LLAMA_HEAD.match(text, lead, partial=True):
                return Start(lead, not m.partial)
        return marker_start(text, self.markers[:1])

    def read(self, text: str, at: int, final: bool) -> Read:
        pos = at
        for prefix in (self.markers[0], ";"):
            if text.startswith(prefix, at):
                pos = skip_space(text, at + len(prefix))
        if pos == len(text):
            return Read.more()
        if text[pos] != "{":
            return Read.malformed(pos)
        end = json_end(text, pos)
        if end is None:
            return Read.more()
        call = json_call(load_json(text[pos:end]), require_arguments=True)
        return Read.of([call], end) if call else Read.malformed(end)


MISTRAL_NAMED = regex.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]")


@dataclass(frozen=True, slots=True)
class MistralSyntax:
    markers: tuple[str, ...] = ("[TOOL_CALLS]",)
    reads: tuple[str, ...] = ("[TOOL_CALLS]", "[CALL_ID]", "[ARGS]")  # Magistral's too

    def find_start(self, text: str, at_output_start: bool, after_call: bool) -> Start | None:
        return marker_start(text, self.markers)

    def read(self, text: str, at: int, final: bool) -> Read:
        pos = skip_space(text, at + len(self.markers[0]))
        if pos == len(text):
            return Read.more()
        if text[pos] == "[":  # v0.3: one JSON array of calls
            end = json_end(text, pos)
            if end is None:
                return Read.more()
            calls = json_calls(load_json(text[pos:end]), require_arguments=False)
            return Read.of(calls, end) if calls else Read.malformed(end)
        named = MISTRAL_NAMED.match(text, pos, partial=True)
        if named is None:
            return Read.malformed(pos)
        if named.end() == len(text):  # a partial match, or nothing after [ARGS] yet
            return Read.more()
        if text[named.end()] != "{":
            return Read.malformed(named.end())
        end = json_end(text, named.end())
        if end is None:
            return Read.more()
        arguments = load_json(text[named.end():end])
        if not isinstance(arguments, dict):
            return Read.malformed(end)
        return Read.of([RawCall(named[1], json.dumps(arguments, ensure_ascii=False))], end)


@dataclass(frozen=True, slots=True)
class Phi4MiniSyntax:
    markers: tuple[str, ...] = ("functools[",)
    reads: tuple[str, ...] = ("functools[",)

    def find_start(self, text: str, at_output_start: bool, after_call: bool) -> Start | None:
        return marker_start(text, self.markers)

    def read(self, text: str, at: int, final: bool) -> Read:
        pos = at + len(self.markers[0]) - 1  # the array's "["
        end = json_end(text, pos)
        if end is None:
            return Read.more()
        calls = json_calls(load_json(text[pos:end]), require_arguments=False)
        return Read.of(calls, end) if calls else Read.malformed(end)


def hermes(tools: tuple[ToolSpec, ...] = ()) -> SyntaxToolParser:
    return SyntaxToolParser("hermes", TaggedSyntax(hermes_body), True, openai_call_id)


def llama3_json(tools: tuple[ToolSpec, ...] = ()) -> SyntaxToolParser:
    """Not parallel: Llama 3.1's template renders one call per assistant turn and raises on
    more, so a history with parallel calls cannot be rendered back (";"-separated calls are
    still read)."""
    return SyntaxToolParser("llama3_json", Llama3JsonSyntax(), False, openai_call_id)


def mistral(tools: tuple[ToolSpec, ...] = ()) -> SyntaxToolParser:
    return SyntaxToolParser("mistral", MistralSyntax(), True, mistral_call_id)


def phi4_mini_json(tools: tuple[ToolSpec, ...] = ()) -> SyntaxToolParser:
    return SyntaxToolParser("phi4_mini_json", Phi4MiniSyntax(), True, openai_call_id)
