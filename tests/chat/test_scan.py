"""loragw.engine.chat.scan: markers found or held while text arrives, and where JSON values and
Python lists end, strings and escapes included."""

from __future__ import annotations

import pytest

from loragw.engine.chat.scan import (
    MarkerScan,
    held_tail,
    json_end,
    python_list_end,
    scan_markers,
)


@pytest.mark.parametrize("text,at", [("abc<thi", 3), ("abc<", 3), ("abc", 3), ("<think", 0),
                                     ("a</", 1), ("a<think>", 8)])
def test_held_tail_is_the_longest_possible_marker_start(text, at):
    assert held_tail(text, ("<think>", "</think>")) == at


def test_scan_finds_the_first_marker_or_holds_a_possible_one():
    markers = ("<think>", "</think>")
    assert scan_markers("x</think>y<think>", markers) == MarkerScan(1, "</think>")
    assert scan_markers("x<think>y</thi", markers) == MarkerScan(1, "<think>")
    assert scan_markers("plain", markers) == MarkerScan(5, None)
    # a marker found is not taken while a longer one that starts there may still come
    assert scan_markers("<a>", ("<a>", "<a>b")) == MarkerScan(0, None)
    assert scan_markers("<a>c", ("<a>", "<a>b")) == MarkerScan(0, "<a>")


@pytest.mark.parametrize("text,start,end", [
    ('x{"a": [1]} y', 1, 11),
    ('{"s": "}]\\"{"}', 0, 14),
    ('[{"a": 1}, {"b": "]"}]tail', 0, 22),
    ('{"open": [1, 2', 0, None),
    ('{"s": "\\', 0, None),
])
def test_json_end(text, start, end):
    assert json_end(text, start) == end


@pytest.mark.parametrize("text,end", [
    ("[f(a='])')]", 11),
    ('[f(a="x\\"]")]!', 13),
    ("[f(a='''it's ]''')] ", 19),
    ("[f(a={'k': [1, (2, 3)]})]", 25),
    ("[f(a='unclosed)]", None),
    ("[f(a=1)", None),
])
def test_python_list_end(text, end):
    assert python_list_end(text, 0) == end
