"""How a chat answer is read, as its family writes it: the thinking apart from the answer (a
ReasoningParser), then the answer's tool calls (a ToolCallParser), engine/chat/'s parsers by
the served model's ChatSetup. One ChoiceReader per choice reads its text as it streams; a whole
response reads the whole text at once through the same reader, so the two give the same
reasoning, content and calls (the parsers guarantee it for any cut of the text).

Where a parser's markers are special tokens of the tokenizer ([TOOL_CALLS], <|python_tag|>,
[THINK]), the request is decoded with special tokens kept (skip_special_tokens false), and the
other special tokens' text is taken out again before anything is read (`strip`).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import regex

from loragw.engine.api import (
    ReasoningParser,
    ThinkTokens,
    ToolCallDelta,
    ToolCallParser,
    seeded_ids,
)


@dataclass(frozen=True)
class ChatReading:
    """What reads one request's answers (decided once, at admission)."""

    reasoning: ReasoningParser | None = None
    tools: ToolCallParser | None = None  # None: calls are not parsed (no tools in play)
    strip: regex.Pattern | None = None  # the special tokens a kept-specials decode shows
    think: ThinkTokens | None = None  # the reasoning markers' ids, to count reasoning tokens
    single_call: bool = False  # parallel_tool_calls false: the first call only
    seed: int = field(default_factory=lambda: random.SystemRandom().randrange(2**32))

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def reader(self, index: int) -> ChoiceReader:
        return ChoiceReader(self, index)


PLAIN = ChatReading()  # nothing to parse: the text is the content


@dataclass(slots=True)
class Piece:
    """What one increment of a choice's text adds."""

    reasoning: str = ""
    content: str = ""
    calls: tuple[ToolCallDelta, ...] = ()


class ChoiceReader:
    def __init__(self, reading: ChatReading, index: int):
        self.reading = reading
        self.thinking = reading.reasoning.stream() if reading.reasoning else None
        ids = (seeded_ids(reading.tools.id_format, reading.seed + index)
               if reading.tools else None)
        self.calling = reading.tools.stream(ids) if reading.tools else None
        self.called = False  # a valid call was read
        self.saw_reasoning = False
        self.output_ids: list[int] = []

    def feed(self, text: str, token_ids: list[int], final: bool) -> Piece:
        """The next increment (`final`: the last one) as reasoning, content and call pieces."""
        self.output_ids.extend(token_ids)
        if self.reading.strip is not None:
            text = self.reading.strip.sub("", text)
        reasoning, content = "", text
        if self.thinking is not None:
            parts = [self.thinking.feed(text)] + ([self.thinking.finish()] if final else [])
            reasoning = "".join(p.reasoning for p in parts)
            content = "".join(p.content for p in parts)
            self.saw_reasoning = self.saw_reasoning or bool(reasoning)
        calls: tuple[ToolCallDelta, ...] = ()
        if self.calling is not None:
            parts = [self.calling.feed(content)] + ([self.calling.finish()] if final else [])
            content = "".join(p.content for p in parts)
            calls = tuple(itertools.chain.from_iterable(p.calls for p in parts))
            if self.reading.single_call:
                calls = tuple(c for c in calls if c.index == 0)
            self.called = self.called or bool(calls)
        return Piece(reasoning, content, calls)

    def reasoning_tokens(self) -> int:
        reading = self.reading
        if reading.reasoning is None or reading.think is None:
            return 0
        return reading.reasoning.count_reasoning_tokens(self.output_ids, reading.think)
