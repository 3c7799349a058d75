"""Structured output on the random demo model at temperature 1.0: the grammar, not the model,
makes every output parse and validate, and unconstrained rows of the same batch are untouched."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from loragw.engine import LLM
from loragw.engine.chat import tool_call_parser
from loragw.engine.request.params import SamplingParams
from loragw.engine.request.structured import GuidedDecoding
from loragw.gateway.openai.tool_calls import tool_call_schema

S = {"type": "string", "maxLength": 8}
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0,
                                                             "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "null"}},
     "required": ["ok", "n"]},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                             "minItems": 2, "maxItems": 4}}, "required": ["xs"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                               "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": S},
        "required": ["x", "y"]}}, "required": ["inner"]},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"q": {
        "type": "object", "properties": {"r": {"enum": [1, 2, 3]}}, "required": ["r"]}},
        "required": ["q"]}}, "required": ["p"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 1, "maxItems": 5},
    {"type": "object", "properties": {"points": {"type": "array", "minItems": 1, "maxItems": 2,
                                                 "items": {"type": "object", "properties": {
                                                     "x": {"type": "integer"},
                                                     "y": {"type": "integer"}},
                                                     "required": ["x", "y"]}}},
     "required": ["points"]},
    {"type": "object", "properties": {"level": {"type": "string",
                                                "enum": ["low", "mid", "high"]},
                                      "score": {"type": "integer", "minimum": 10,
                                                "maximum": 20}},
     "required": ["level", "score"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}},
     "required": ["id"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}},
     "required": ["v"]},
    {"type": "object", "properties": {"a": S, "b": S, "c": {"type": "integer"}},
     "required": ["a", "c"], "additionalProperties": False},
    {"type": "object", "properties": {"m": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": {"type": "boolean"}, "maxItems": 2}}}, "required": ["m"]},
    {"type": "object", "properties": {"k": {"const": "fixed"}, "n": {"type": "integer",
                                                                      "exclusiveMinimum": 0}},
     "required": ["k", "n"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": S, "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]},
                             "minItems": 1, "maxItems": 3}}, "required": ["name", "roles"]}},
     "required": ["user"]},
    {"enum": ["alpha", "beta", 7, True]},
    {"type": "object", "properties": {"d": {"type": "string", "minLength": 2, "maxLength": 4}},
     "required": ["d"]},
    {"type": "object", "properties": {"x": {"type": "integer", "minimum": 100, "maximum": 105},
                                      "y": {"type": "array", "items": S, "minItems": 1,
                                            "maxItems": 1}}, "required": ["x", "y"]},
]


@pytest.fixture(scope="module")
def llm(demo_model) -> LLM:
    return LLM(demo_model, max_model_len=1024, max_num_seqs=32)


def guided(kind, spec=None, seed=0, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 400), temperature=1.0, seed=seed,
                          guided=GuidedDecoding(kind, spec), **kw)


def test_twenty_schemas_parse_and_validate_at_temperature_one(llm):
    assert len(SCHEMAS) == 20
    params = [guided("json_schema", s, seed=i) for i, s in enumerate(SCHEMAS)]
    outs = llm.generate(["Answer in JSON:"] * len(params), params)
    for schema, out in zip(SCHEMAS, outs, strict=True):
        assert out.finish_reason == "stop", (schema, out.text)  # the grammar ended it
        jsonschema.validate(json.loads(out.text), schema)


def test_keys_come_in_the_schemas_order(llm):
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": S},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    (out,) = llm.generate(["JSON:"], [guided("json_schema", schema, seed=9)])
    assert list(json.loads(out.text)) == ["zeta", "alpha"]


def test_json_object_regex_and_choice(llm):
    params = [guided("json_object", seed=1, max_tokens=600),
              guided("regex", r"[a-z]{3}-\d{2}", seed=2),
              guided("choice", ["yes", "no way", "maybe \"so\""], seed=3)]
    obj, reg, choice = llm.generate(["Say:"] * 3, params)
    if obj.finish_reason == "stop":  # an unbounded object may run to max_tokens at T=1
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")
    assert re.fullmatch(r"[a-z]{3}-\d{2}", reg.text) and reg.finish_reason == "stop"
    assert choice.text in ("yes", "no way", "maybe \"so\"") and choice.finish_reason == "stop"


def test_mixed_batch_leaves_unconstrained_rows_unchanged(llm):
    prompts = ["The river", "Once upon", "Hello", "A cat"]
    free = [SamplingParams(max_tokens=12, temperature=0.0),
            SamplingParams(max_tokens=12, temperature=1.0, seed=7)]
    solo = [llm.generate(p, f)[0].token_ids for p, f in zip(prompts[:2], free)]
    constrained = [guided("json_schema", SCHEMAS[1], seed=3), guided("choice", ["a", "b"])]
    mixed = llm.generate(prompts, free + constrained)
    assert [m.token_ids for m in mixed[:2]] == solo
    jsonschema.validate(json.loads(mixed[2].text), SCHEMAS[1])
    assert mixed[3].text in ("a", "b")


def test_mixed_batch_across_adapters_leaves_unconstrained_rows_unchanged(demo_model,
                                                                        demo_adapters):
    """Constrained and unconstrained rows on different adapters (and the base model) in one
    batch, with fewer slots than adapters: every free row equals its solo run, greedy and
    seeded, and every constrained row still parses."""
    llm = LLM(demo_model, max_model_len=512, max_num_seqs=16, max_loras=2)
    for name, path in demo_adapters.items():
        llm.add_adapter(name, path)
    names = sorted(demo_adapters)  # chef, pirate, poet, robot
    free = [("Tell me about the sea", SamplingParams(max_tokens=16, temperature=0.0), names[0]),
            ("Hello there", SamplingParams(max_tokens=16, temperature=1.0, seed=11), names[1]),
            ("What do you do?", SamplingParams(max_tokens=16, temperature=0.0), None),
            ("A story", SamplingParams(max_tokens=16, temperature=0.8, seed=5), names[3])]
    solo = [llm.generate(p, f, adapters=[a])[0].token_ids for p, f, a in free]
    constrained = [("Answer in JSON:", guided("json_schema", SCHEMAS[2], seed=1), names[0]),
                   ("Pick:", guided("choice", ["yes", "no"], seed=2), names[2]),
                   ("Answer in JSON:", guided("json_schema", SCHEMAS[4], seed=3), None),
                   ("Code:", guided("regex", r"[a-z]{2}\d", seed=4), names[1])]
    rows = [free[0], constrained[0], free[1], constrained[1], free[2], constrained[2],
            free[3], constrained[3]]
    mixed = llm.generate([r[0] for r in rows], [r[1] for r in rows],
                         adapters=[r[2] for r in rows])
    assert [mixed[i].token_ids for i in (0, 2, 4, 6)] == solo
    jsonschema.validate(json.loads(mixed[1].text), SCHEMAS[2])
    assert mixed[3].text in ("yes", "no")
    jsonschema.validate(json.loads(mixed[5].text), SCHEMAS[4])
    assert re.fullmatch(r"[a-z]{2}\d", mixed[7].text)
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("bad, problem", [
    (GuidedDecoding("json_schema", {"type": "frobnicate"}), "frobnicate"),
    (GuidedDecoding("json_schema", "{not json"), "not valid JSON"),
    (GuidedDecoding("regex", "a(b"), "parenthesis"),
])
def test_invalid_spec_is_a_value_error_naming_the_problem(llm, bad, problem):
    with pytest.raises(ValueError, match=problem):
        llm.engine.add_request("hi", SamplingParams(guided=bad))
    assert not llm.engine.has_unfinished()


def test_guided_decoding_checks_its_spec():
    with pytest.raises(ValueError, match="kind"):
        GuidedDecoding("yaml", "x")
    with pytest.raises(ValueError, match="non-empty list"):
        GuidedDecoding("choice", [])


def test_tool_call_schema_and_parse(llm):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": S, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}},
             {"type": "function", "function": {"name": "add", "parameters": {
                 "type": "object", "properties": {"a": {"type": "integer"},
                                                  "b": {"type": "integer"}},
                 "required": ["a", "b"]}}}]
    schema = tool_call_schema(tools, ["get_weather", "add"])
    outs = llm.generate(["Call:"] * 4, [guided("json_schema", schema, seed=i) for i in range(4)])
    parser = tool_call_parser("llama3_json")()  # what reads a forced call (chat_setup.py)
    for out in outs:
        (call,) = parser.parse(out.text, lambda: "call_0").calls
        params = next(t["function"]["parameters"] for t in tools
                      if t["function"]["name"] == call.name)
        jsonschema.validate(json.loads(call.arguments), params)
    assert parser.parse("plain text", lambda: "call_0").calls == ()


def test_without_xgrammar_only_structured_output_is_refused(llm, monkeypatch):
    import loragw.engine.request.structured as structured

    monkeypatch.setattr(structured, "xgr", None)
    with pytest.raises(ValueError, match="xgrammar"):
        structured.GrammarCompiler(llm.tokenizer, 100, [0])
