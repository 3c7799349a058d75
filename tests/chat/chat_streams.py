"""Feeding the chat parsers a text in pieces, and putting what their streams send back together.

    pieces = random_pieces(text, random.Random(seed))   # cut anywhere, inside markers too
    streamed = stream_tools(parser, pieces, ids)         # -> ToolParseResult, checked in shape

`stream_tools` also checks the shape of what a stream sends: each call's first piece is its
header (id and name, no arguments), every later piece of it an arguments fragment (no id, no
name), and calls come in index order, one after another.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from loragw.engine.chat import ReasoningParser, ToolCall, ToolCallParser, ToolParseResult
from loragw.engine.chat.tool_calls import CallIds


def random_pieces(text: str, rng: random.Random, most: int = 12) -> list[str]:
    """`text` cut at up to `most` random places (empty pieces included now and then)."""
    cuts = sorted(rng.choice(range(len(text) + 1)) for _ in range(rng.randint(0, most)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def every_two_pieces(text: str) -> Iterator[list[str]]:
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]


def stream_reasoning(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    """(reasoning, content) joined from a stream fed `pieces`."""
    stream = parser.stream()
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


def stream_tools(parser: ToolCallParser, pieces: list[str], ids: CallIds) -> ToolParseResult:
    """The content and calls a stream fed `pieces` sends, joined; asserts the pieces' shape."""
    stream = parser.stream(ids)
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    content, calls = "", []
    for delta in deltas:
        content += delta.content
        for piece in delta.calls:
            if piece.id is not None:
                assert piece.index == len(calls) and piece.name and piece.arguments == "", piece
                calls.append(ToolCall(piece.id, piece.name, ""))
            else:
                assert piece.index == len(calls) - 1 and piece.name is None, piece
                last = calls[-1]
                calls[-1] = ToolCall(last.id, last.name, last.arguments + piece.arguments)
    return ToolParseResult(content, tuple(calls))
