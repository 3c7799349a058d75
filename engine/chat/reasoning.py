"""Reasoning kept apart from the answer: a model's text between a start and an end marker.

    deepseek_r1   <think>...</think>  R1-distill's generation prompt already opened <think>, so
                  the output starts INSIDE thinking: "I add.</think>4" -> ("I add.", "4")
    qwen3         <think>...</think>  thinking starts where the output writes <think>: "4" -> (None,
                  "4"), as with enable_thinking=false, whose prompt already closed an empty block
    mistral       [THINK]...[/THINK]  likewise: "[THINK]add[/THINK]4" -> ("add", "4")

One state machine reads all three: BEFORE (no thinking yet; text is content), THINKING (text is
reasoning) and ANSWER (everything is content, markers included). A start marker enters THINKING
(and is dropped wherever thinking is open); an end marker closes it and is dropped; an end
marker before any thinking is dropped too. A thinking section never closed before the output
ends (max_tokens) leaves everything after its start as reasoning and the content empty, as vLLM
does for each of the three (deepseek_r1: all reasoning; qwen3 with thinking on: all reasoning;
mistral: text after [THINK] is reasoning, text before it content).

Where this differs from vLLM, on outputs a well-prompted model does not write: vLLM's
non-streamed deepseek_r1 drops text written before a <think>, here it stays reasoning (as in
vLLM's own streaming); vLLM's qwen3 treats text before a stray </think> as reasoning (and
splits there even with enable_thinking=false), here the stray marker is dropped and the text
stays content; a second start marker inside thinking is dropped, where vLLM keeps it in the
reasoning text. Each rule decides at the marker, so a stream never takes back what it sent.

The text read is the output decoded with special tokens kept ([THINK] and [/THINK] are special
tokens; Qwen's and R1's <think> are not, but a caller should not rely on that).

The token predicates (`answer_start`, `count_reasoning_tokens`) run the same machine over the
OUTPUT's token ids, starting from the parser's initial phase (vLLM instead scans prompt and
output backwards for the last marker): a grammar may constrain the answer from `answer_start`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from loragw.engine.chat.scan import scan_markers


class Phase(enum.Enum):
    BEFORE = "before"  # no thinking yet: text is content, a start marker opens thinking
    THINKING = "thinking"  # text is reasoning until an end marker
    ANSWER = "answer"  # thinking is over: everything is content


class ReasoningSplit(NamedTuple):
    """A whole output, split: reasoning is None when the output never entered thinking."""

    reasoning: str | None
    content: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """What one piece of streamed text adds to the reasoning and to the content."""

    reasoning: str = ""
    content: str = ""


@dataclass(frozen=True, slots=True)
class ThinkTokens:
    """The token ids of the start and end markers, looked up in a tokenizer's vocabulary."""

    start: frozenset[int]
    end: frozenset[int]


class ReasoningStream(Protocol):
    def feed(self, delta_text: str) -> ReasoningDelta: ...

    def finish(self) -> ReasoningDelta: ...


class ReasoningParser(Protocol):
    """Splits an output's reasoning from its content, whole or as it streams."""

    name: str
    start_marker: str
    end_marker: str

    def split(self, text: str) -> ReasoningSplit: ...

    def stream(self) -> ReasoningStream: ...

    def think_tokens(self, vocab: Mapping[str, int]) -> ThinkTokens: ...

    def answer_start(self, output_ids: Sequence[int], marks: ThinkTokens) -> int | None: ...

    def reasoning_ended(self, output_ids: Sequence[int], marks: ThinkTokens) -> bool: ...

    def count_reasoning_tokens(self, output_ids: Sequence[int], marks: ThinkTokens) -> int: ...


@dataclass(frozen=True, slots=True)
class ThinkTagParser:
    """A ReasoningParser for a start and an end marker; `initial` is where an output begins
    (THINKING when the generation prompt opened the block, ANSWER when it closed one)."""

    name: str
    start_marker: str
    end_marker: str
    initial: Phase = Phase.BEFORE

    def split(self, text: str) -> ReasoningSplit:
        """The whole output at once: exactly what stream() gives, joined."""
        stream = self.stream()
        first, last = stream.feed(text), stream.finish()
        reasoning = first.reasoning + last.reasoning
        return ReasoningSplit(reasoning if stream.entered else None, first.content + last.content)

    def stream(self) -> ThinkStream:
        return ThinkStream(self)

    def think_tokens(self, vocab: Mapping[str, int]) -> ThinkTokens:
        """The markers' ids; a marker that is not one token of `vocab` is refused."""
        missing = [m for m in (self.start_marker, self.end_marker) if m not in vocab]
        if missing:
            raise ValueError(f"reasoning parser {self.name!r} needs {missing} as tokens of the "
                             "tokenizer (added tokens); this tokenizer splits them into pieces, "
                             "so pick the parser of this model's family")
        return ThinkTokens(frozenset({vocab[self.start_marker]}),
                           frozenset({vocab[self.end_marker]}))

    def phases(self, output_ids: Sequence[int], marks: ThinkTokens) -> list[Phase]:
        """The phase each output token is read in (a marker token is read in the phase it ends)."""
        phase, out = self.initial, []
        for token in output_ids:
            out.append(phase)
            if phase is Phase.BEFORE and token in marks.start:
                phase = Phase.THINKING
            elif phase is Phase.THINKING and token in marks.end:
                phase = Phase.ANSWER
        return out

    def answer_start(self, output_ids: Sequence[int], marks: ThinkTokens) -> int | None:
        """Index of the first output token of the answer, from which a grammar may constrain it:
        0 when the output starts in the answer, the index after the end marker that closed
        thinking, or None while thinking is open or has not happened yet."""
        if self.initial is Phase.ANSWER:
            return 0
        phases = self.phases(output_ids, marks)
        for i, (phase, token) in enumerate(zip(phases, output_ids)):
            if phase is Phase.THINKING and token in marks.end:
                return i + 1
        return None

    def reasoning_ended(self, output_ids: Sequence[int], marks: ThinkTokens) -> bool:
        return self.answer_start(output_ids, marks) is not None

    def count_reasoning_tokens(self, output_ids: Sequence[int], marks: ThinkTokens) -> int:
        """Output tokens read inside thinking, the markers themselves not counted."""
        return sum(phase is Phase.THINKING and token not in marks.start | marks.end
                   for phase, token in zip(self.phases(output_ids, marks), output_ids))


@dataclass(slots=True)
class ThinkStream:
    """One output of `parser`, fed piece by piece; holds back only a tail that may be the start
    of a marker, so `feed(a) + feed(b)` gives what `feed(a + b)` gives."""

    parser: ThinkTagParser
    phase: Phase = field(init=False)
    entered: bool = field(init=False)  # whether the output was ever inside thinking
    held: str = ""

    def __post_init__(self) -> None:
        self.phase = self.parser.initial
        self.entered = self.phase is Phase.THINKING

    def feed(self, delta_text: str) -> ReasoningDelta:
        return self._read(self.held + delta_text, final=False)

    def finish(self) -> ReasoningDelta:
        return self._read(self.held, final=True)

    def _read(self, text: str, final: bool) -> ReasoningDelta:
        reasoning, content = [], []
        markers = (self.parser.start_marker, self.parser.end_marker)
        while text and self.phase is not Phase.ANSWER:
            found = scan_markers(text, markers)
            upto = len(text) if final and found.marker is None else found.at
            (reasoning if self.phase is Phase.THINKING else content).append(text[:upto])
            text = text[upto:]
            if found.marker is None:
                break
            text = text[len(found.marker):]
            if found.marker == self.parser.start_marker and self.phase is Phase.BEFORE:
                self.phase, self.entered = Phase.THINKING, True
            elif found.marker == self.parser.end_marker and self.phase is Phase.THINKING:
                self.phase = Phase.ANSWER
        if self.phase is Phase.ANSWER:
            content.append(text)
            text = ""
        self.held = text
        return ReasoningDelta("".join(reasoning), "".join(content))


def deepseek_r1() -> ThinkTagParser:
    """DeepSeek-R1 (and its Qwen/Llama distills): the generation prompt ends with `<think>\\n`."""
    return ThinkTagParser("deepseek_r1", "<think>", "</think>", Phase.THINKING)


def qwen3(enable_thinking: bool = True) -> ThinkTagParser:
    """Qwen3: the model opens <think> itself; with the chat template's enable_thinking=False the
    prompt holds an empty closed block and the whole output is the answer."""
    return ThinkTagParser("qwen3", "<think>", "</think>",
                          Phase.BEFORE if enable_thinking else Phase.ANSWER)


def mistral() -> ThinkTagParser:
    """Magistral and the Mistral models with [THINK] / [/THINK] special tokens."""
    return ThinkTagParser("mistral", "[THINK]", "[/THINK]")
