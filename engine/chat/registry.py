"""The parsers by vLLM's names (`--reasoning-parser`, `--tool-call-parser`), and which ones a
chat template asks for, read from the markers it writes.

    reasoning_parser("qwen3")(enable_thinking=False)   -> a ReasoningParser
    tool_call_parser("qwen3_coder")(tools=specs)        -> a ToolCallParser (every factory takes
                                                           the request's tools; qwen3_coder
                                                           reads their schemas, no parser
                                                           checks call names against them)
    tool_parser_for_template(tokenizer.chat_template)   -> "hermes", ... or None
    reasoning_parser_for_template(template)             -> "qwen3", ... or None

Template markers, most specific first:

    tool calls   <tool_call> with <function=        qwen3_coder    (Qwen3-Coder)
                 <tool_call>                        hermes         (Qwen2.5, Qwen3, Hermes)
                 [TOOL_CALLS]                       mistral
                 functools                          phi4_mini_json (Phi-4-mini)
                 [func_name1(... / "python list"    pythonic       (Llama 3.2 / 4, Gemma 3)
                 <|python_tag|> or "parameters"     llama3_json    (Llama 3.1 / 3.2 JSON)
                 with <|start_header_id|>
    reasoning    [THINK]                            mistral        (Magistral)
                 <think> with enable_thinking       qwen3
                 <think> opened by the generation   deepseek_r1    (R1 and its distills,
                 prompt                                            Qwen3 thinking-2507)

A template that only strips <think> blocks from earlier turns says nothing about whether the
model thinks (Qwen3-2507 Instruct's does that and never thinks), so it gets None. Jinja comments
({# ... #}) are not read: a comment that names a marker asks for nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import regex

from loragw.engine.chat import reasoning
from loragw.engine.chat.json_calls import hermes, llama3_json, mistral, phi4_mini_json
from loragw.engine.chat.pythonic import pythonic
from loragw.engine.chat.qwen3_coder import qwen3_coder
from loragw.engine.chat.reasoning import ReasoningParser
from loragw.engine.chat.tool_calls import ToolCallParser

REASONING_PARSERS: Mapping[str, Callable[..., ReasoningParser]] = MappingProxyType({
    "deepseek_r1": reasoning.deepseek_r1,
    "qwen3": reasoning.qwen3,
    "mistral": reasoning.mistral,
})
TOOL_CALL_PARSERS: Mapping[str, Callable[..., ToolCallParser]] = MappingProxyType({
    "hermes": hermes,
    "llama3_json": llama3_json,
    "mistral": mistral,
    "phi4_mini_json": phi4_mini_json,
    "pythonic": pythonic,
    "qwen3_coder": qwen3_coder,
})


def _lookup(kind: str, flag: str, table: Mapping[str, Callable], name: str) -> Callable:
    if name not in table:
        raise ValueError(f"unknown {kind} parser {name!r} ({flag}); supported: "
                         f"{', '.join(sorted(table))}")
    return table[name]


def reasoning_parser(name: str) -> Callable[..., ReasoningParser]:
    """The factory of reasoning parser `name`; a ValueError names the supported ones."""
    return _lookup("reasoning", "--reasoning-parser", REASONING_PARSERS, name)


def tool_call_parser(name: str) -> Callable[..., ToolCallParser]:
    """The factory of tool-call parser `name` (it takes `tools`); a ValueError names the
    supported ones."""
    return _lookup("tool-call", "--tool-call-parser", TOOL_CALL_PARSERS, name)


PYTHONIC_EXAMPLE = regex.compile(r"\[\s*func_name\d*\(|python list", regex.IGNORECASE)
COMMENT = regex.compile(r"\{#.*?#\}", regex.DOTALL)
GENERATION_PROMPT = regex.compile(
    r"\{%-?\s*if\s+add_generation_prompt\b[^%]*-?%\}(.*?)\{%-?\s*(?:endif|else|elif)\b",
    regex.DOTALL)


def tool_parser_for_template(template: str) -> str | None:
    """The tool-call parser a chat template's markers ask for (module docstring), or None."""
    template = COMMENT.sub("", template)
    if "<tool_call>" in template:
        return "qwen3_coder" if "<function=" in template else "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "functools" in template:
        return "phi4_mini_json"
    if PYTHONIC_EXAMPLE.search(template):
        return "pythonic"
    if "<|python_tag|>" in template or (
            '"parameters"' in template and "<|start_header_id|>" in template):
        return "llama3_json"
    return None


def opens_thinking(template: str) -> bool:
    """Whether the template's generation prompt writes <think> without closing it."""
    return any("<think>" in block and "</think>" not in block.partition("<think>")[2]
               for block in GENERATION_PROMPT.findall(template))


def reasoning_parser_for_template(template: str) -> str | None:
    """The reasoning parser a chat template's markers ask for (module docstring), or None."""
    template = COMMENT.sub("", template)
    if "[THINK]" in template:
        return "mistral"
    if "<think>" in template and "enable_thinking" in template:
        return "qwen3"
    if opens_thinking(template):
        return "deepseek_r1"
    return None
