"""Reading text that is still arriving: where a marker begins (or may begin, cut in half at the
end of what has come), and where a JSON value or a Python list that opens at a given place ends.

Each answer depends only on the text given and never changes once given, whatever arrives after
it: a marker found is found for good, a tail held as "may be a marker" is held until the text
decides, an end found is the end. The parsers' streams rest on that to give the same result for
any split of a text into pieces.

    scan_markers("abc<thi", ("<think>",))   -> MarkerScan(at=3, marker=None): "<thi" held
    scan_markers("a<think>b", ("<think>",)) -> MarkerScan(at=1, marker="<think>")
    json_end('x{"a": [1]} y', 1)            -> 11
    python_list_end("[f(a='])')]", 0)        -> 11
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MarkerScan:
    """text[:at] is plain text; `marker` begins at `at`, or, when it is None, text[at:] may still
    become a marker (at == len(text) when nothing is held)."""

    at: int
    marker: str | None


def held_tail(text: str, markers: Sequence[str]) -> int:
    """Where the longest tail of `text` that is a proper prefix of some marker begins;
    len(text) when no tail is."""
    longest = max((len(m) for m in markers), default=0)
    for start in range(max(0, len(text) - longest + 1), len(text)):
        tail = text[start:]
        if any(len(m) > len(tail) and m.startswith(tail) for m in markers):
            return start
    return len(text)


def scan_markers(text: str, markers: Sequence[str]) -> MarkerScan:
    """The first marker in `text`, unless a tail that may still become a marker (or a longer
    one) begins at or before it: then that tail is held."""
    found = [(text.find(m), -len(m), m) for m in markers if m in text]
    held = held_tail(text, markers)
    if found:
        at, _, marker = min(found)
        if at < held:
            return MarkerScan(at, marker)
    return MarkerScan(held, None)


def json_end(text: str, start: int) -> int | None:
    """Index just past the JSON object or array opening at text[start] (`{` or `[`); None while
    it is not closed. Counts brackets outside strings only; json.loads judges the rest."""
    assert text[start] in "{[", text[start:start + 10]
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def python_list_end(text: str, start: int) -> int | None:
    """Index just past the Python list opening at text[start] (`[`); None while it is not closed.
    Skips string literals ('..', "..", triple-quoted, with backslash escapes)."""
    assert text[start] == "[", text[start:start + 10]
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c in "'\"":
            quote = c * 3 if text.startswith(c * 3, i) else c
            j = i + len(quote)
            while not text.startswith(quote, j):
                if j >= len(text):
                    return None
                j += 2 if text[j] == "\\" else 1
            i = j + len(quote)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None
