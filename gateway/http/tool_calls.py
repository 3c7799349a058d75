"""Tool calls out of a chat choice's text, piece by piece as it streams.

A call is written as `{"name": N, "arguments": {...}}` — what `tool_call_schema` constrains
`tool_choice: required` / named to, and what the demo, Qwen and Hermes templates ask for in
`auto` — optionally wrapped in `<tool_call></tool_call>`, several in a row. The parser decides as
early as the text allows:

    text so far                                  what goes out
    '  {"na'                                     nothing yet: it may become a call
    '{"name": "get_weather", "arguments": '      the call's header: index, id, type, name
    '... {"city": "Par'                          an arguments fragment: '{"city": "Par'
    '... "}}'                                    the rest of the arguments; the wrapper's '}' is dropped
    'Sure! ...'                                  content: the text is not a call

Keys in another order (`{"arguments": ..., "name": ...}`) are held to the end and parsed whole.
One parser serves a stream (`feed` per increment, then `finish`) and a whole response (both at
once), so both see the same calls with the same argument text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import regex  # partial matching: is this text the start of a call header?

HEADER = regex.compile(r'\s*(?:<tool_call>\s*)?\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,'
                       r'\s*"arguments"\s*:\s*')
CLOSE_BRACE = regex.compile(r"\s*\}")  # closes the call after its arguments
CLOSE_TAG = "</tool_call>"
Mode = Literal["start", "arguments", "trailer", "content", "held"]


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


def parse_tool_call(text: str, names: list[str]) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) if `text` is one call {"name", "arguments"} of an
    allowed tool, optionally inside <tool_call></tool_call> (the demo and Qwen templates' tags)."""
    body = text.strip()
    if body.startswith("<tool_call>") and body.endswith("</tool_call>"):
        body = body[len("<tool_call>"):-len("</tool_call>")].strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not (isinstance(call, dict) and call.get("name") in names
            and isinstance(call.get("arguments"), dict)):
        return None
    return call["name"], json.dumps(call["arguments"], ensure_ascii=False)


@dataclass(slots=True)
class CallPiece:
    """Part of call `index`: its header (id and name set, arguments "") or an arguments
    fragment (id and name None)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class Update:
    content: str = ""
    calls: list[CallPiece] = field(default_factory=list)

    def __iadd__(self, other: Update) -> Update:
        self.content += other.content
        self.calls += other.calls
        return self


@dataclass(slots=True)
class Call:
    id: str
    name: str
    arguments: str = ""
    closed: bool = False  # its arguments object ended

    @property
    def valid(self) -> bool:
        try:
            return self.closed and isinstance(json.loads(self.arguments), dict)
        except json.JSONDecodeError:
            return False


class ToolCallParser:
    """One chat choice's text -> content and tool calls, for the allowed tool `names`."""

    def __init__(self, names: list[str]):
        self.names = names
        self.calls: list[Call] = []
        self.mode: Mode = "start"
        self.buffer = ""  # text not yet given out, in start/trailer/held mode
        self.value_end = JsonValueEnd()

    @property
    def called(self) -> bool:
        """Whether the text held at least one complete, valid call (finish_reason tool_calls)."""
        return bool(self.calls) and all(c.valid for c in self.calls)

    def feed(self, text: str) -> Update:
        self.buffer += text
        update = Update()
        while True:  # each pass consumes the buffer, or waits for more text
            mode = self.mode
            if mode == "content":
                update.content, self.buffer = update.content + self.buffer, ""
                return update
            if mode == "held":
                return update
            if mode == "arguments":
                update += self._arguments()
            elif mode == "start":
                update += self._start()
            else:
                self._trailer()
            if self.mode == mode:
                return update  # no progress: the text so far is a prefix, wait for more

    def finish(self) -> Update:
        """The end of the text: what is still held goes out as a call or as content."""
        update = Update()
        if self.mode == "trailer":
            self._trailer(final=True)
        if self.mode == "held":
            parsed = parse_tool_call(self.buffer, self.names)
            if parsed is not None:
                call = self._open(parsed[0], update)
                call.arguments, call.closed = parsed[1], True
                update.calls.append(CallPiece(len(self.calls) - 1, parsed[1]))
                self.buffer = ""
        if self.buffer.strip():
            update.content += self.buffer  # never became a call
        self.buffer, self.mode = "", "content"
        return update

    # ---- modes --------------------------------------------------------------------------
    def _start(self) -> Update:
        update = Update()
        match = HEADER.match(self.buffer, partial=True)
        if match is not None and match.partial:
            return update  # may still become a call header
        if match is None or (name := _json_string(match.group(1))) not in self.names:
            body = self.buffer.lstrip()
            whole_object = body.startswith(("{", "<tool_call>"))
            self.mode = "held" if whole_object and match is None and not self.calls else "content"
            return update
        self._open(name, update)
        self.buffer = self.buffer[match.end():]
        self.mode = "arguments"
        return update

    def _arguments(self) -> Update:
        call = self.calls[-1]
        text = self.buffer if call.arguments else self.buffer.lstrip()
        end = self.value_end.feed(text)
        piece = text if end is None else text[:end]
        call.arguments += piece
        self.buffer = "" if end is None else text[end:]
        if end is not None:
            call.closed, self.value_end, self.mode = True, JsonValueEnd(), "trailer"
        return Update(calls=[CallPiece(len(self.calls) - 1, piece)] if piece else [])

    def _trailer(self, final: bool = False) -> None:
        """After the arguments: the wrapper's "}" and, maybe, a closing tag."""
        brace = CLOSE_BRACE.match(self.buffer)
        if brace is None:
            if final or self.buffer.strip():
                self.mode = "content"  # a call closed wrongly: say the rest as it is
            return
        rest = self.buffer[brace.end():]
        tag = rest.lstrip()
        if not final and CLOSE_TAG.startswith(tag):
            return  # the tag may still be arriving
        self.buffer = tag[len(CLOSE_TAG):] if tag.startswith(CLOSE_TAG) else rest
        self.mode = "start"

    def _open(self, name: str, update: Update) -> Call:
        call = Call(id=f"call_{uuid.uuid4().hex[:24]}", name=name)
        self.calls.append(call)
        update.calls.append(CallPiece(len(self.calls) - 1, "", call.id, name))
        return call


class JsonValueEnd:
    """Where one JSON object or array ends, fed a piece at a time (string and escape aware)."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int | None:
        """The index in `text` just past the value's closing bracket, or None if not yet."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return None


def _json_string(body: str) -> str | None:
    try:
        return json.loads(f'"{body}"')
    except json.JSONDecodeError:
        return None


__all__ = ["CallPiece", "ToolCallParser", "Update"]
