"""ToolCallParser: the same calls and content however the text is split into increments."""

from __future__ import annotations

import json
import random

import pytest

from loragw.gateway.http.tool_calls import ToolCallParser, Update

NAMES = ["get_weather", "add"]
WEATHER = '{"name":"get_weather","arguments":{"city":"a}b\\"{","unit":"c"}}'
TWO_TAGGED = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {"x": 3}]}}\n'
              '</tool_call>\n<tool_call>{"name":"get_weather","arguments":{}}</tool_call>')

# text -> (content, [(name, arguments text)], called)
CASES = [
    (WEATHER, ("", [("get_weather", '{"city":"a}b\\"{","unit":"c"}')], True)),
    ("  " + TWO_TAGGED, ("", [("add", '{"a": 1, "b": [2, {"x": 3}]}'),
                              ("get_weather", "{}")], True)),
    ('Sure, let me check {"name":"add"}', ('Sure, let me check {"name":"add"}', [], False)),
    ('{"name":"nope","arguments":{}}', ('{"name":"nope","arguments":{}}', [], False)),
    # keys in another order: held to the end, then parsed whole
    ('{"arguments":{"a":1,"b":2},"name":"add"}', ("", [("add", '{"a": 1, "b": 2}')], True)),
    # cut short (max_tokens): the call streamed so far, but not a complete one
    ('{"name":"add","arguments":{"a":1', ("", [("add", '{"a":1')], False)),
    ('{"name":"add","arguments":{"a":1}} trailing', (" trailing", [("add", '{"a":1}')], True)),
    ('{"name":"add","arguments":{"a":1}}</tool_c', ("</tool_c", [("add", '{"a":1}')], True)),
    ('{"name": "ad', ('{"name": "ad', [], False)),
    ("", ("", [], False)),
    ("Hello", ("Hello", [], False)),
]


def parse(text: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]], bool, list]:
    parser = ToolCallParser(NAMES)
    update = Update()
    for piece in pieces:
        update += parser.feed(piece)
    update += parser.finish()
    calls: list[list[str]] = []
    for piece in update.calls:
        if piece.id is not None:
            assert piece.index == len(calls) and piece.arguments == ""
            calls.append([piece.name, ""])
        else:
            assert piece.name is None
            calls[piece.index][1] += piece.arguments
    return update.content, [tuple(c) for c in calls], parser.called, update.calls


def split(text: str, rng: random.Random, most: int) -> list[str]:
    pieces, at = [], 0
    while at < len(text):
        size = rng.randint(1, most)
        pieces.append(text[at:at + size])
        at += size
    return pieces


@pytest.mark.parametrize("text, expected", CASES)
def test_same_result_for_every_split(text, expected):
    rng = random.Random(0)
    for most in (1, 2, 5, len(text) or 1):
        for _ in range(4):
            content, calls, called, _ = parse(text, split(text, rng, most))
            assert (content, calls, called) == (expected[0], expected[1], expected[2]), most


def test_call_streams_before_the_text_ends():
    parser = ToolCallParser(NAMES)
    assert parser.feed('{"name": "add", ').calls == []  # not yet known to be a call
    head = parser.feed('"arguments": ').calls
    assert [(p.index, p.name, p.arguments) for p in head] == [(0, "add", "")]
    assert head[0].id.startswith("call_")
    assert [p.arguments for p in parser.feed('{"a": 1').calls] == ['{"a": 1']
    assert [p.arguments for p in parser.feed(', "b": 2}}').calls] == [', "b": 2}']
    assert parser.finish().content == "" and parser.called


def test_content_is_not_held_back():
    parser = ToolCallParser(NAMES)
    assert parser.feed("The weather").content == "The weather"
    assert parser.feed(' is {"name"').content == ' is {"name"'


def test_arguments_are_json_once_joined():
    _, calls, called, _ = parse(TWO_TAGGED, list(TWO_TAGGED))
    assert called and [json.loads(a) for _, a in calls] == [{"a": 1, "b": [2, {"x": 3}]}, {}]
