"""One reader for every tool-call syntax: a family describes where a call starts and how one is
read (a CallSyntax); this module streams text through it and gives a ToolCallParser.

The reader walks the text once, left to right:

    find_start   the first place a call begins for sure (`sure`), or may begin once more text
                 comes (not sure: the text from there is held back), or nowhere (all content)
    read         at a sure start: the calls read there and where they end, or MALFORMED (that
                 text is content, verbatim), or MORE (wait for text; at the end it is MALFORMED)

A call goes out when it is whole and valid, as a header delta then its arguments: a call sent
cannot be taken back when its JSON later breaks, and a malformed call must come back as content
— so exactness wins over streaming the arguments of a call still being written. Content streams
as it comes, except a tail that may begin a call and trailing whitespace (which waits for what
follows it). The whitespace just before a call, and after the last call at the end of the
output, is dropped: "Let me check.\n<call>\nDone." has the content "Let me check.\nDone.". An
output with no call keeps its text verbatim.

Every decision depends only on text already seen and never changes as more arrives, which is
what makes a stream split anywhere give exactly what `parse` gives for the whole text. A call
still being written is read again from its start when text arrives (O(call length) per piece).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from loragw.engine.chat.tool_calls import (
    CallIds,
    IdFormat,
    ToolCall,
    ToolCallDelta,
    ToolParseResult,
    ToolStreamDelta,
)


@dataclass(frozen=True, slots=True)
class Start:
    """A call begins at `at` (sure), or may begin there (not sure: hold the text from `at`)."""

    at: int
    sure: bool


@dataclass(frozen=True, slots=True)
class RawCall:
    """A call read from the text, before it has an id: its arguments as JSON text."""

    name: str
    arguments: str


class Outcome(enum.Enum):
    CALLS = "calls"  # calls read; the text up to `end` is consumed
    MALFORMED = "malformed"  # the text up to `end` is no call: it is content, verbatim
    MORE = "more"  # undecided until more text comes


@dataclass(frozen=True, slots=True)
class Read:
    outcome: Outcome
    end: int = 0
    calls: tuple[RawCall, ...] = ()

    @classmethod
    def more(cls) -> Read:
        return cls(Outcome.MORE)

    @classmethod
    def malformed(cls, end: int) -> Read:
        return cls(Outcome.MALFORMED, end)

    @classmethod
    def of(cls, calls: Sequence[RawCall], end: int) -> Read:
        return cls(Outcome.CALLS, end, tuple(calls))


class CallSyntax(Protocol):
    """One family's syntax. `text` is what has not been consumed yet; `at_output_start` says it
    begins the output (nothing consumed), `after_call` that it directly follows a call."""

    markers: tuple[str, ...]  # text at which a call may begin
    reads: tuple[str, ...]  # every marker it reads (kept in the text where special tokens)

    def find_start(self, text: str, at_output_start: bool, after_call: bool) -> Start | None: ...

    def read(self, text: str, at: int, final: bool) -> Read: ...


def whitespace_tail(text: str, end: int) -> int:
    """Where the run of whitespace that ends at text[end] begins."""
    return len(text[:end].rstrip())


@dataclass(frozen=True, slots=True)
class SyntaxToolParser:
    """A ToolCallParser made of a CallSyntax (see ToolCallParser for the fields)."""

    name: str
    syntax: CallSyntax
    parallel: bool
    id_format: IdFormat

    @property
    def call_markers(self) -> tuple[str, ...]:
        return self.syntax.markers

    @property
    def syntax_tokens(self) -> tuple[str, ...]:
        return self.syntax.reads

    def parse(self, text: str, ids: CallIds) -> ToolParseResult:
        stream = self.stream(ids)
        content, calls = [], {}
        for delta in (stream.feed(text), stream.finish()):
            content.append(delta.content)
            for piece in delta.calls:
                if piece.id is not None:
                    calls[piece.index] = ToolCall(piece.id, piece.name or "", "")
                else:
                    call = calls[piece.index]
                    calls[piece.index] = ToolCall(call.id, call.name,
                                                  call.arguments + piece.arguments)
        return ToolParseResult("".join(content), tuple(calls[i] for i in sorted(calls)))

    def stream(self, ids: CallIds) -> SyntaxStream:
        return SyntaxStream(self.syntax, ids)


@dataclass(slots=True)
class SyntaxStream:
    """One output read through `syntax`, piece by piece (see the module docstring)."""

    syntax: CallSyntax
    ids: CallIds
    text: str = ""  # what has arrived and is not consumed yet
    pristine: bool = True  # nothing consumed: `text` begins the output
    after_call: bool = False  # `text` directly follows a call
    count: int = 0  # calls sent
    pieces: list[ToolCallDelta] = field(default_factory=list)
    content: list[str] = field(default_factory=list)

    def feed(self, delta_text: str) -> ToolStreamDelta:
        self.text += delta_text
        return self._advance(final=False)

    def finish(self) -> ToolStreamDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> ToolStreamDelta:
        while self._step(final):
            pass
        out = ToolStreamDelta("".join(self.content), tuple(self.pieces))
        self.content, self.pieces = [], []
        return out

    def _step(self, final: bool) -> bool:
        """Consume what the text decides; True to look again, False to wait for more text."""
        if self.after_call and final and not self.text.strip():
            self.text = ""  # the whitespace after the last call
            return False
        start = self.syntax.find_start(self.text, self.pristine, self.after_call)
        if start is None or (final and not start.sure):
            end = len(self.text)
            self._take_content(end if final else whitespace_tail(self.text, end))
            return False
        cut = whitespace_tail(self.text, start.at)  # the whitespace before a call waits for it
        self._take_content(cut)
        if not start.sure:
            return False
        at = start.at - cut
        read = self.syntax.read(self.text, at, final)
        if read.outcome is Outcome.MORE and final:
            read = Read.malformed(len(self.text))
        if read.outcome is Outcome.MORE:
            return False
        if read.outcome is Outcome.MALFORMED:
            assert read.end > at, (read, self.text[at:at + 40])
            self._take_content(read.end)
            return True
        assert read.end > at and not self.text[:at].strip(), (read, self.text[:at])
        for call in read.calls:
            self.pieces.append(ToolCallDelta(self.count, self.ids(), call.name, ""))
            self.pieces.append(ToolCallDelta(self.count, arguments=call.arguments))
            self.count += 1
        self.text = self.text[read.end:]
        self.pristine, self.after_call = False, True
        return True

    def _take_content(self, end: int) -> None:
        """Send text[:end] as content (nothing when end is 0)."""
        if end == 0:
            return
        self.content.append(self.text[:end])
        self.text = self.text[end:]
        self.pristine = self.after_call = False
