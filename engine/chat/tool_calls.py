"""The nouns of tool calling: a call as OpenAI's API returns it, the pieces a stream sends, the
tools a request declares, call ids, and the interface every family's parser offers.

    parser = tool_call_parser("hermes")()
    ids = seeded_ids(parser.id_format, seed=0)
    parser.parse('Sure.\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>', ids)
        -> ToolParseResult(content="Sure.", calls=(ToolCall("call_9a...", "f", '{"x": 1}'),))

A stream sends, for each call in turn, a header (its index, id and name, arguments "") and then
its arguments; joining a stream's pieces gives exactly what `parse` returns for the same text,
ids included when both draw from the same id source.

The text a parser reads is the output decoded with special tokens kept: Mistral's [TOOL_CALLS]
and [ARGS] and Llama's <|python_tag|> are special tokens, which skip_special_tokens drops.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

IdFormat = Callable[[random.Random], str]  # draws one call id from a random source
CallIds = Callable[[], str]  # the next call id, injected by the caller (deterministic in tests)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call, as OpenAI's `message.tool_calls[i]` (type "function"): arguments as JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of call `index`: its header (id and name set, arguments "") or an arguments
    fragment (id and name None)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class ToolStreamDelta:
    """What one piece of streamed text adds: content text and call pieces (in that order)."""

    content: str = ""
    calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolParseResult:
    """A whole output read: its content (the text that is no call) and its calls."""

    content: str
    calls: tuple[ToolCall, ...]


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool a request declares: its name and its parameters' JSON schema."""

    name: str
    parameters: Mapping[str, object] = field(default_factory=dict)

    @classmethod
    def from_openai(cls, tool: Mapping[str, object]) -> ToolSpec:
        """From `{"type": "function", "function": {"name", "parameters"}}` (or the inner part)."""
        function = tool.get("function", tool)
        if not isinstance(function, Mapping) or "name" not in function:
            raise ValueError(f"a tool must be {{\"type\": \"function\", \"function\": "
                             f"{{\"name\": ..., \"parameters\": {{...}}}}}}, got {str(tool)[:200]}")
        return cls(str(function["name"]), dict(function.get("parameters") or {}))

    def parameter_type(self, parameter: str) -> str | None:
        """The JSON schema type of `parameter` (the first non-null one of a list), None when the
        schema does not declare the parameter or its type."""
        properties = self.parameters.get("properties")
        declared = properties.get(parameter) if isinstance(properties, Mapping) else None
        kind = declared.get("type") if isinstance(declared, Mapping) else None
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), None)
        return kind if isinstance(kind, str) else None


def openai_call_id(rng: random.Random) -> str:
    """`call_` and 24 hex digits, as vLLM's default ids."""
    return "call_" + "".join(rng.choices("0123456789abcdef", k=24))


def mistral_call_id(rng: random.Random) -> str:
    """9 letters and digits: what Mistral's templates and mistral-common accept."""
    return "".join(rng.choices(string.ascii_letters + string.digits, k=9))


def seeded_ids(id_format: IdFormat, seed: int) -> CallIds:
    """Call ids in `id_format`, the same sequence for the same seed."""
    rng = random.Random(seed)
    return lambda: id_format(rng)


def tools_by_name(tools: Sequence[ToolSpec]) -> Mapping[str, ToolSpec]:
    return {tool.name: tool for tool in tools}


class ToolCallStream(Protocol):
    def feed(self, delta_text: str) -> ToolStreamDelta: ...

    def finish(self) -> ToolStreamDelta: ...


class ToolCallParser(Protocol):
    """Reads one family's tool-call syntax out of an output's content.

    call_markers: text at which a call may begin (a caller holding back text that may become a
    call holds it from these); syntax_tokens: every marker the syntax reads, which a decode
    must keep where they are special tokens (Magistral's [ARGS]); parallel: whether the family's template can render several calls
    in one assistant turn; id_format: how the family's call ids look."""

    name: str
    call_markers: tuple[str, ...]
    syntax_tokens: tuple[str, ...]
    parallel: bool
    id_format: IdFormat

    def parse(self, text: str, ids: CallIds) -> ToolParseResult: ...

    def stream(self, ids: CallIds) -> ToolCallStream: ...
