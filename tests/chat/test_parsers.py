"""loragw.engine.chat's parsers: what each reads out of a whole output, that a stream fed the
same text cut anywhere (inside markers too) gives exactly the same, ids included; malformed calls
coming back as content; values typed by the tool's schema (qwen3_coder); the registries; which
parsers the fixture templates ask for; and parsing text that a family's tokenizer encoded and
decoded with its special tokens kept."""

from __future__ import annotations

import json
import random
import re

import pytest
from chat_families import CALL_ARGUMENTS, FAMILIES, WEATHER_TOOL, conversation, render
from chat_streams import every_two_pieces, random_pieces, stream_reasoning, stream_tools

from loragw.engine.chat import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ThinkTokens,
    ToolSpec,
    reasoning_parser,
    reasoning_parser_for_template,
    seeded_ids,
    tool_call_parser,
    tool_parser_for_template,
)
from loragw.engine.chat.qwen3_coder import convert

SEEDS = range(60)
WEATHER = ToolSpec.from_openai(WEATHER_TOOL)
GW = '{"name": "get_weather", "arguments": {"city": "Paris"}}'

# (parser, its factory's options, output, reasoning, content)
REASONING_CASES = [
    ("deepseek_r1", {}, "I add 2 and 2.\n</think>\n\n4", "I add 2 and 2.\n", "\n\n4"),
    ("deepseek_r1", {}, "<think>\nI add.\n</think>\n\n4", "\nI add.\n", "\n\n4"),
    ("deepseek_r1", {}, "Still thinking when max_tokens hit", "Still thinking when max_tokens hit",
     ""),
    ("deepseek_r1", {}, "", "", ""),
    ("deepseek_r1", {}, "abc</think>x</think>y<think>", "abc", "x</think>y<think>"),
    ("qwen3", {}, "<think>\nHmm.\n</think>\n\nHello", "\nHmm.\n", "\n\nHello"),
    ("qwen3", {}, "Hello, no thinking here.", None, "Hello, no thinking here."),
    ("qwen3", {}, "<think>\nstill going", "\nstill going", ""),
    ("qwen3", {}, "Hi <think>a</think>b", "a", "Hi b"),
    ("qwen3", {}, "a</think>b", None, "ab"),
    ("qwen3", {"enable_thinking": False}, "<think>x</think>y", None, "<think>x</think>y"),
    ("mistral", {}, "[THINK]add[/THINK]4", "add", "4"),
    ("mistral", {}, "x[THINK]add", "add", "x"),
    ("mistral", {}, "4", None, "4"),
    ("mistral", {}, "a[/THINK]b", None, "ab"),
    ("mistral", {}, "[THINK]a[THINK]b[/THINK]c[THINK]d", "ab", "c[THINK]d"),
]


def reasoner(name: str, options: dict):
    return reasoning_parser(name)(**options)


@pytest.mark.parametrize("name,options,text,reasoning,content", REASONING_CASES)
def test_reasoning_split(name, options, text, reasoning, content):
    assert reasoner(name, options).split(text) == (reasoning, content)


@pytest.mark.parametrize("name,options,text,reasoning,content", REASONING_CASES)
def test_reasoning_stream_matches_split_for_any_cut(name, options, text, reasoning, content):
    parser = reasoner(name, options)
    expected = (reasoning or "", content)
    splits = [list(text)] + list(every_two_pieces(text))
    splits += [random_pieces(text, random.Random(seed)) for seed in SEEDS]
    for pieces in splits:
        assert stream_reasoning(parser, pieces) == expected, pieces


def test_reasoning_stream_holds_only_a_possible_marker():
    stream = reasoning_parser("qwen3")().stream()
    assert stream.feed("<thi").content == ""  # may be <think>
    assert stream.feed("nk>I").reasoning == "I"
    assert stream.feed("dea</th").reasoning == "dea"  # "</th" waits
    delta = stream.feed("ink>\n\nDone <")
    assert (delta.reasoning, delta.content) == ("", "\n\nDone <")  # no holding once answering


VOCAB = {"<think>": 1, "</think>": 2, "[THINK]": 3, "[/THINK]": 4}


@pytest.mark.parametrize("name,options,ids,start,count", [
    ("deepseek_r1", {}, [5, 6, 2, 7, 8], 3, 2),
    ("deepseek_r1", {}, [5, 6, 7], None, 3),
    ("deepseek_r1", {}, [1, 5, 2, 7], 3, 1),
    ("qwen3", {}, [1, 5, 6, 2, 7], 4, 2),
    ("qwen3", {}, [5, 6, 2, 7], None, 0),
    ("qwen3", {}, [1, 5, 6], None, 2),
    ("qwen3", {"enable_thinking": False}, [1, 5, 2], 0, 0),
    ("mistral", {}, [9, 3, 5, 4, 6], 4, 1),
    ("mistral", {}, [9, 4, 6], None, 0),
])
def test_token_predicates(name, options, ids, start, count):
    parser = reasoner(name, options)
    marks = parser.think_tokens(VOCAB)
    assert parser.answer_start(ids, marks) == start
    assert parser.reasoning_ended(ids, marks) is (start is not None)
    assert parser.count_reasoning_tokens(ids, marks) == count


def test_token_predicates_agree_with_the_text(chat_tokenizers):
    tokenizer = chat_tokenizers["qwen3"]
    parser = reasoning_parser("qwen3")()
    text = "<think>\nI add two and two.\n</think>\n\nIt is 4."
    ids = tokenizer.encode(text, add_special_tokens=False)
    marks = parser.think_tokens(tokenizer.get_vocab())
    reasoning, content = parser.split(text)
    assert parser.count_reasoning_tokens(ids, marks) == len(
        tokenizer.encode(reasoning, add_special_tokens=False))
    assert tokenizer.decode(ids[parser.answer_start(ids, marks):]) == content


def test_think_tokens_refuses_a_tokenizer_without_the_markers():
    with pytest.raises(ValueError, match=r"\[THINK\]"):
        reasoning_parser("mistral")().think_tokens({"<think>": 1, "</think>": 2})
    assert reasoning_parser("qwen3")().think_tokens(VOCAB) == ThinkTokens(frozenset({1}),
                                                                          frozenset({2}))


def calls(*pairs: tuple[str, dict]) -> list[tuple[str, dict]]:
    """The calls a case expects: (name, arguments) pairs."""
    return list(pairs)


VERBATIM = None  # the expected content is the whole output, unchanged

# (parser, output, content, [(name, arguments)])
TOOL_CASES = [
    ("hermes", f"<tool_call>\n{GW}\n</tool_call>", "", calls(("get_weather", {"city": "Paris"}))),
    ("hermes", f"Let me check.\n\n<tool_call>\n{GW}\n</tool_call>\n<tool_call>\n"
     '{"name": "get_time", "arguments": {}}\n</tool_call>\n', "Let me check.",
     calls(("get_weather", {"city": "Paris"}), ("get_time", {}))),
    ("hermes", f"<tool_call>{GW}</tool_call>\nDone.", "\nDone.",
     calls(("get_weather", {"city": "Paris"}))),
    ("hermes", 'A <tool_call>{"name": "f", "arguments": {</tool_call> B',
     'A <tool_call>{"name": "f", "arguments": {</tool_call> B', []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', VERBATIM, []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1}}', "", calls(("f", {"x": 1}))),
    ("hermes", 'Hi <tool_call>{"name": "f", "argu', 'Hi <tool_call>{"name": "f", "argu', []),
    ("hermes", "  Plain answer, a <tool mention ", "  Plain answer, a <tool mention ", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "",
     calls(("f", {"x": 1}))),
    ("hermes", '<tool_call>{"name": "f", "parameters": {"é": "ü"}}</tool_call>', "",
     calls(("f", {"é": "ü"}))),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     calls(("get_weather", {"city": "Paris"}))),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; '
     '{"name": "b", "parameters": {"x": [1, 2]}}', "", calls(("a", {}), ("b", {"x": [1, 2]}))),
    ("llama3_json", 'Checking.<|python_tag|>{"name": "a", "parameters": {}}', "Checking.",
     calls(("a", {}))),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("llama3_json", 'Here: {"name": "a", "parameters": {}}', VERBATIM, []),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")',
     '<|python_tag|>brave_search.call(query="x")', []),
    ("llama3_json", '\n {"name": "a", "arguments": {"k": "v"}} ', "", calls(("a", {"k": "v"}))),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {}}]', "",
     calls(("get_weather", {"city": "Paris"}), ("get_time", {}))),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
     "Sure.", calls(("get_weather", {"city": "Paris"}), ("get_time", {}))),
    ("mistral", '[TOOL_CALLS]f[CALL_ID]abc123XYZ[ARGS]{"a": 1}', "", calls(("f", {"a": 1}))),
    ("mistral", "[TOOL_CALLS]get weather[ARGS]{}", "[TOOL_CALLS]get weather[ARGS]{}", []),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": }', '[TOOL_CALLS]f[ARGS]{"a": }', []),
    ("mistral", '[TOOL_CALLS] [{"name": "f"}, 3]', '[TOOL_CALLS] [{"name": "f"}, 3]', []),
    ("pythonic", '[get_weather(city="Paris", days=3)]', "",
     calls(("get_weather", {"city": "Paris", "days": 3}))),
    ("pythonic", "[get_weather(city='Paris'), get_time(tz=\"UTC\", offset=-1.5, "
     'flags=[True, None], opts={"a": (1, 2)})]', "",
     calls(("get_weather", {"city": "Paris"}),
           ("get_time", {"tz": "UTC", "offset": -1.5, "flags": [True, None],
                         "opts": {"a": [1, 2]}}))),
    ("pythonic", "[f(on=true, off=false, none=null, s='])')]", "",
     calls(("f", {"on": True, "off": False, "none": None, "s": "])"}))),
    ("pythonic", "Ok.\n<|python_start|>[f(x=1)]<|python_end|>\nDone.", "Ok.\nDone.",
     calls(("f", {"x": 1}))),
    ("pythonic", '[get_weather("Paris")]', '[get_weather("Paris")]', []),
    ("pythonic", '[f(x=os.system("ls"))]', '[f(x=os.system("ls"))]', []),
    ("pythonic", "[f(x=city)]", "[f(x=city)]", []),  # a variable, not a literal
    ("pythonic", "[1, 2] are numbers", "[1, 2] are numbers", []),
    ("pythonic", "Sure: [f(x=1)]", "Sure: [f(x=1)]", []),
    ("pythonic", "[f(x=1)] trailing", " trailing", calls(("f", {"x": 1}))),
    ("pythonic", "[f(x=1), g(y=", "[f(x=1), g(y=", []),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "parameters": {}}]', "",
     calls(("get_weather", {"city": "Paris"}), ("get_time", {}))),
    ("phi4_mini_json", 'I will call it: functools[{"name": "f", "arguments": {}}]',
     "I will call it:", calls(("f", {}))),
    ("phi4_mini_json", "use functools.reduce here", "use functools.reduce here", []),
    ("phi4_mini_json", 'functools[{"name": "f", "arguments": [1]}]',
     'functools[{"name": "f", "arguments": [1]}]', []),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
     "<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=note>\n7\n</parameter>\n"
     "<parameter=days_off>\nnull\n</parameter>\n</function>\n</tool_call>", "",
     calls(("get_weather", {"city": "Paris", "days": 3, "metric": True, "hours": [1, 2],
                            "note": "7", "days_off": None}))),
    ("qwen3_coder", "Looking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n"
     "</parameter>\n<parameter=days>\n2\n</function>\n</tool_call>\n<tool_call>\n"
     "<function=get_time>\n</function>\n</tool_call>", "Looking.",
     calls(("get_weather", {"city": "New\nYork", "days": 2}), ("get_time", {}))),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=days>\n2.5\n</parameter>\n"
     "<parameter=metric>\nyes\n</parameter>\n<parameter=city>\n3\n</parameter>\n</function>\n"
     "</tool_call>", "", calls(("get_weather", {"days": "2.5", "metric": "yes", "city": "3"}))),
    ("qwen3_coder", '<tool_call>\n{"name": "f"}\n</tool_call>', VERBATIM, []),
]


def tool_parser(name: str):
    return tool_call_parser(name)(tools=(WEATHER,))


def check_result(result, content, expected):
    assert result.content == content
    assert [(c.name, c.arguments) for c in result.calls] == [
        (name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in expected]


@pytest.mark.parametrize("name,text,content,expected", TOOL_CASES)
def test_tool_calls_parse(name, text, content, expected):
    parser, content = tool_parser(name), text if content is VERBATIM else content
    check_result(parser.parse(text, seeded_ids(parser.id_format, 0)), content, expected)


@pytest.mark.parametrize("name,text,content,expected", TOOL_CASES)
def test_tool_stream_matches_parse_for_any_cut(name, text, content, expected):
    parser, content = tool_parser(name), text if content is VERBATIM else content
    whole = parser.parse(text, seeded_ids(parser.id_format, 7))
    check_result(whole, content, expected)
    splits = [list(text)] + list(every_two_pieces(text))
    splits += [random_pieces(text, random.Random(seed)) for seed in SEEDS]
    for pieces in splits:
        assert stream_tools(parser, pieces, seeded_ids(parser.id_format, 7)) == whole, pieces


def test_call_ids_have_each_family_format():
    for name in TOOL_CALL_PARSERS:
        parser = tool_call_parser(name)()
        ids = seeded_ids(parser.id_format, 3)
        drawn = [ids() for _ in range(50)]
        assert len(set(drawn)) == 50
        pattern = r"[A-Za-z0-9]{9}" if name == "mistral" else r"call_[0-9a-f]{24}"
        assert all(re.fullmatch(pattern, i) for i in drawn), (name, drawn[:3])
    parser = tool_call_parser("mistral")()
    result = parser.parse("[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{}",
                          seeded_ids(parser.id_format, 1))
    expected = seeded_ids(parser.id_format, 1)
    assert [c.id for c in result.calls] == [expected(), expected()]


def test_parsers_declare_markers_and_parallelism():
    markers = {name: tool_call_parser(name)().call_markers for name in TOOL_CALL_PARSERS}
    assert markers["hermes"] == markers["qwen3_coder"] == ("<tool_call>",)
    assert markers["mistral"] == ("[TOOL_CALLS]",)
    assert "<|python_tag|>" in markers["llama3_json"]
    assert markers["phi4_mini_json"] == ("functools[",)
    assert not tool_call_parser("llama3_json")().parallel
    assert tool_call_parser("hermes")().parallel


def test_unknown_parser_names_are_refused_with_the_supported_ones():
    with pytest.raises(ValueError, match="unknown tool-call parser 'hermes2'.*supported: hermes, "
                       "llama3_json, mistral, phi4_mini_json, pythonic, qwen3_coder"):
        tool_call_parser("hermes2")
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'.*supported: deepseek_r1, "
                       "mistral, qwen3"):
        reasoning_parser("r1")
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "mistral", "qwen3"]


# (reasoning parser, tool parser, output, reasoning, content, call names)
COMBINED = [
    ("deepseek_r1", "hermes", f"I need the weather.\n</think>\n\n<tool_call>\n{GW}\n</tool_call>",
     "I need the weather.\n", "", ["get_weather"]),
    ("qwen3", "hermes", f"<think>\nx\n</think>\n\nLet me check.\n<tool_call>\n{GW}\n</tool_call>",
     "\nx\n", "\n\nLet me check.", ["get_weather"]),  # as vLLM, the answer's newlines stay
    ("mistral", "mistral", "[THINK]x[/THINK][TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[ARGS]{}", "x", "",
     ["f", "g"]),
    ("qwen3", "qwen3_coder", "<think>\nMentioning <tool_call> while thinking.\n</think>\n\n"
     "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     "\nMentioning <tool_call> while thinking.\n", "", ["get_time"]),
]


@pytest.mark.parametrize("reasoning_name,tool_name,text,reasoning,content,names", COMBINED)
def test_calls_after_reasoning_streamed_and_whole(reasoning_name, tool_name, text, reasoning,
                                                  content, names):
    thinker, caller = reasoning_parser(reasoning_name)(), tool_parser(tool_name)
    split = thinker.split(text)
    whole = caller.parse(split.content, seeded_ids(caller.id_format, 5))
    assert (split.reasoning, whole.content, [c.name for c in whole.calls]) == (
        reasoning, content, names)
    for seed in SEEDS:
        thinking = thinker.stream()
        said, answer = "", []
        for piece in random_pieces(text, random.Random(seed)) + [None]:
            delta = thinking.feed(piece) if piece is not None else thinking.finish()
            said += delta.reasoning
            answer.append(delta.content)
        assert said == reasoning
        assert stream_tools(caller, answer, seeded_ids(caller.id_format, 5)) == whole


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_templates_name_their_parsers(name):
    family = FAMILIES[name]
    assert tool_parser_for_template(family.template_text) == family.tool_parser
    assert reasoning_parser_for_template(family.template_text) == family.reasoning_parser


def test_template_detection_reads_markers_not_comments():
    assert tool_parser_for_template("{# <tool_call> #}{{ messages }}") is None
    assert reasoning_parser_for_template("{% if add_generation_prompt %}<think>\n\n</think>"
                                         "{% endif %}") is None  # closed: no thinking opened
    assert reasoning_parser_for_template("{%- if add_generation_prompt %}{{ '<think>\\n' }}"
                                         "{%- endif %}") == "deepseek_r1"
    assert tool_parser_for_template('<|start_header_id|>{"name": "f", "parameters": {}}') == (
        "llama3_json")


def completion(tokenizer, family, messages, **kwargs) -> str:
    """What the model writes for the last (assistant) message: the rendered conversation less
    the rendered prompt before it, up to the end of the turn."""
    prompt = render(tokenizer, messages[:-1], add_generation_prompt=True, **kwargs)
    full = render(tokenizer, messages, **kwargs)
    assert full.startswith(prompt), (prompt[-80:], full[len(prompt) - 80:])
    return full[len(prompt):].partition(family.end_of_turn)[0]


@pytest.mark.parametrize("name", sorted(n for n, f in FAMILIES.items() if f.tool_parser))
def test_parsing_what_the_family_tokenizer_decodes(chat_tokenizers, name):
    family, tokenizer = FAMILIES[name], chat_tokenizers[name]
    reasoning = "I should look it up." if family.reasoning_parser else None
    # no system message: Mistral v0.3 writes it into the last user turn, wherever that is
    messages = conversation(family, reasoning=reasoning)[1:3]
    if name == "magistral":  # Magistral's thinking travels as a content chunk
        messages[1]["content"] = [{"type": "thinking", "thinking": reasoning}]
    kwargs = {"tools": [WEATHER_TOOL], "date_string": "26 Jul 2024"}
    text = completion(tokenizer, family, messages, **kwargs)
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded = tokenizer.decode(ids, skip_special_tokens=False)
    assert decoded == text
    content = decoded
    if family.reasoning_parser:
        split = reasoning_parser(family.reasoning_parser)().split(decoded)
        assert split.reasoning.strip() == reasoning
        content = split.content
    parser = tool_parser(family.tool_parser)
    check_result(parser.parse(content, seeded_ids(parser.id_format, 0)), "",
                 [("get_weather", CALL_ARGUMENTS)])
    # a decode that skips special tokens loses the markers of the families that mark them special
    special = [t.content for t in family.tokens if t.special and t.content in text]
    stripped = tokenizer.decode(ids, skip_special_tokens=True)
    assert (stripped != decoded) is bool(special)
    if set(special) & set(parser.call_markers):
        assert parser.parse(stripped, seeded_ids(parser.id_format, 0)).calls == ()


def test_r1_reasoning_from_what_its_tokenizer_decodes(chat_tokenizers):
    family = FAMILIES["deepseek_r1_distill_qwen"]
    tokenizer = chat_tokenizers[family.name]
    prompt = render(tokenizer, [{"role": "user", "content": "2+2?"}], add_generation_prompt=True)
    assert prompt.endswith("<think>\n")  # so the output starts inside thinking
    output = "Two and two.\n</think>\n\nIt is 4.<｜end▁of▁sentence｜>"
    ids = tokenizer.encode(output, add_special_tokens=False)
    parser = reasoning_parser("deepseek_r1")()
    text = tokenizer.decode(ids, skip_special_tokens=True)  # </think> is no special token here
    assert parser.split(text) == ("Two and two.\n", "\n\nIt is 4.")
    assert parser.answer_start(ids, parser.think_tokens(tokenizer.get_vocab())) is not None


COMMON = [" ", "\n", "Hi", "{", "}", "[", "]", '"', ":", ",", ";", "(", ")", "=", "'", "x", "1",
          "\\", '"name"', '"arguments"', '"parameters"', "true", '{"name": "f", "arguments": {}}']
# per syntax: whole calls, and pieces of its markup
CALLS = {
    "hermes": ['<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'],
    "llama3_json": ['<|python_tag|>{"name": "f", "parameters": {}}',
                    '{"name": "g", "arguments": {}}'],
    "mistral": ['[TOOL_CALLS]f[ARGS]{"a": [1]}', '[TOOL_CALLS] [{"name": "f", "arguments": {}}]'],
    "pythonic": ["[f(x=1)]", "<|python_start|>[f(x='a')]<|python_end|>"],
    "qwen3_coder": ["<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n"
                    "</function>\n</tool_call>"],
    "phi4_mini_json": ['functools[{"name": "f", "arguments": {}}]'],
}
FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool", "_call>"],
    "llama3_json": ["<|python_tag|>", "; ", "<|python"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "f"],
    "pythonic": ["<|python_start|>", "<|python_end|>", "f(", "x=", "[f(", "'])'"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=get_weather>", "</function>",
                    "<parameter=days>", "</parameter>", "<parameter="],
    "phi4_mini_json": ["functools[", "functools"],
}


@pytest.mark.parametrize("name", sorted(FRAGMENTS))
def test_tool_stream_matches_parse_on_random_texts(name):
    """Texts strung together from whole calls, pieces of the syntax and other text, well-formed
    or not: parsing never raises, and a stream cut anywhere gives what parse gives."""
    parser, rng = tool_parser(name), random.Random(name)
    choices = CALLS[name] * 6 + FRAGMENTS[name] * 3 + COMMON
    with_calls = refused = 0
    for _ in range(300):
        text = "".join(rng.choice(choices) for _ in range(rng.randint(1, 10)))
        whole = parser.parse(text, seeded_ids(parser.id_format, 1))
        with_calls += bool(whole.calls)
        refused += any(m in whole.content for m in parser.call_markers if len(m) > 1)
        for _ in range(4):
            pieces = random_pieces(text, rng)
            assert stream_tools(parser, pieces, seeded_ids(parser.id_format, 1)) == whole, pieces
    assert with_calls >= 20 and refused >= 20, (with_calls, refused)  # both kinds were tried


@pytest.mark.parametrize("name,options", [("deepseek_r1", {}), ("qwen3", {}), ("mistral", {}),
                                          ("qwen3", {"enable_thinking": False})])
def test_reasoning_stream_matches_split_on_random_texts(name, options):
    parser, rng = reasoner(name, options), random.Random(name)
    fragments = ["<think>", "</think>", "<thi", "nk>", "</", "[THINK]", "[/THINK]", "[/TH", "a",
                 " ", "\n", "<", "["]
    for _ in range(300):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 12)))
        reasoning, content = parser.split(text)
        for _ in range(4):
            assert stream_reasoning(parser, random_pieces(text, rng)) == (reasoning or "", content)


@pytest.mark.parametrize("text,kind,value", [
    ("3", "integer", 3), ("3.5", "integer", "3.5"), ("3.5", "number", 3.5), ("3.0", "number", 3),
    ("1e400", "number", "1e400"), ("nan", "number", "nan"), ("True", "boolean", True),
    ("false", "bool", False), ("yes", "boolean", "yes"), ('{"a": 1}', "object", {"a": 1}),
    ("{'a': (1, 2)}", "object", {"a": [1, 2]}), ("[1, 2]", "array", [1, 2]),
    ("null", "string", None), ("Null", "integer", None), ("abc", None, "abc"), ("7", "enum", "7"),
    ("{'a': {1, 2}}", "object", "{'a': {1, 2}}"),
])
def test_qwen3_coder_values_follow_the_schema_type(text, kind, value):
    assert json.dumps(convert(text, kind)) == json.dumps(value)


@pytest.mark.parametrize("tool", [{"type": "function", "function": "get_weather"},
                                  {"type": "function", "function": {"parameters": {}}}])
def test_a_malformed_tool_is_a_named_error(tool):
    with pytest.raises(ValueError, match="a tool must be"):
        ToolSpec.from_openai(tool)
