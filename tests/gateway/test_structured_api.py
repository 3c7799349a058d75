"""Structured output and tool calls through the live gateway and the openai client, on the
random demo model at temperature 1.0 (the grammar alone makes the outputs valid)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

BASE = "demo-base"  # conftest's served model name
ADAPTER = "lora-1"
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "temp": {"type": "integer", "minimum": -30, "maximum": 50},
    "tags": {"type": "array", "items": {"enum": ["sun", "rain"]}, "minItems": 1, "maxItems": 3}},
    "required": ["city", "temp", "tags"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA,
                                                 "strict": True}}
MESSAGES = [{"role": "user", "content": "What is the weather?"}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather now",
                                      "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
T1 = {"temperature": 1.0, "max_tokens": 150}  # the server holds 512 tokens


@pytest.mark.parametrize("model", [BASE, ADAPTER])
def test_json_schema_response_format_streamed_or_not(client, model):
    whole = client.chat.completions.create(model=model, messages=MESSAGES, seed=1,
                                           response_format=FORMAT, **T1)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMA)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, seed=2,
                                                 response_format=FORMAT, stream=True, **T1))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completions_route_and_vllm_extensions(client):
    r = client.completions.create(model=BASE, prompt="JSON:", seed=3,
                                  extra_body={"response_format": FORMAT}, **T1)
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = client.completions.create(model=BASE, prompt="Pick:", extra_body={
        "guided_choice": ["left", "right"]}, **T1)
    assert r.choices[0].text in ("left", "right")
    r = client.completions.create(model=BASE, prompt="Code:", extra_body={
        "guided_regex": r"[A-Z]{2}\d{3}"}, **T1)
    assert len(r.choices[0].text) == 5 and r.choices[0].text[:2].isupper()
    r = client.chat.completions.create(model=BASE, messages=MESSAGES, seed=4,
                                       extra_body={"guided_json": SCHEMA}, **T1)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


@pytest.mark.parametrize("body, problem", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frobnicate"}}}}, "frobnicate"),
    ({"guided_regex": "a(b"}, "regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "only one"),
])
def test_invalid_constraints_are_400_naming_the_problem(client, body, problem):
    with pytest.raises(openai.BadRequestError, match=problem):
        client.chat.completions.create(model=BASE, messages=MESSAGES, extra_body=body, **T1)


@pytest.mark.parametrize("tool_choice, allowed", [
    ("required", ["get_weather", "add"]),
    ({"type": "function", "function": {"name": "add"}}, ["add"]),
])
def test_forced_tool_calls_parse_and_validate(client, tool_choice, allowed):
    r = client.chat.completions.create(model=ADAPTER, messages=MESSAGES, tools=TOOLS,
                                       tool_choice=tool_choice, n=3, seed=5, **T1)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    chunks = list(client.chat.completions.create(model=ADAPTER, messages=MESSAGES, tools=TOOLS,
                                                 tool_choice=tool_choice, stream=True, seed=6,
                                                 **T1))
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    head, *fragments = pieces  # OpenAI's shape: id, type and name first, then argument text
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name in allowed and head.function.arguments == ""
    # a call streams once it is whole (a call that turns out malformed stays content), then its
    # arguments: the same call the whole response gives
    assert fragments and all(f.index == 0 and f.id is None and f.function.name is None
                             for f in fragments)
    arguments = "".join(f.function.arguments for f in fragments)
    jsonschema.validate(json.loads(arguments), PARAMS[head.function.name])
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_unknown_named_tool_is_400(client):
    with pytest.raises(openai.BadRequestError, match="nope"):
        client.chat.completions.create(model=BASE, messages=MESSAGES, tools=TOOLS, tool_choice={
            "type": "function", "function": {"name": "nope"}}, **T1)


def test_auto_and_none_leave_the_output_free(client):
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model=BASE, messages=MESSAGES, tools=TOOLS,
                                           tool_choice=choice, temperature=0, max_tokens=8)
        assert r.choices[0].message.tool_calls is None
        assert r.choices[0].finish_reason in ("stop", "length")
