"""How one served model speaks chat: its template and kwargs, the parsers of its thinking and
its tool calls, whether `auto` tool choice parses calls, and its sampling defaults. The base
model's is decided once at start from the flags (`auto` reads the chat template's markers and
logs its choice); an adapter that brings its own template, parsers or generation_config.json
gets a ChatSetup of its own over the base's (gateway/openai/adapter_chats.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace

import regex

from loragw.engine.api import (
    ChatTemplate,
    GenerationDefaults,
    GuidedDecoding,
    ReasoningParser,
    ThinkTokens,
    ToolCallParser,
    ToolSpec,
    generation_defaults,
    reasoning_parser,
    reasoning_parser_for_template,
    tool_call_parser,
    tool_parser_for_template,
)
from loragw.gateway.common.config import ServerConfig
from loragw.gateway.common.errors import APIError
from loragw.gateway.openai.chat_reading import ChatReading
from loragw.gateway.openai.forced_calls import forced_call
from loragw.gateway.openai.protocol import ChatCompletionRequest

logger = logging.getLogger(__name__)
MAX_TEMPLATE_BYTES = 1024 * 1024


@dataclass(frozen=True)
class ChatSetup:
    template: ChatTemplate = field(default_factory=ChatTemplate)
    reasoning: str | None = None  # the reasoning parser's name (None: the answer is all)
    tools: str | None = None  # the tool-call parser's name (None: calls are not parsed)
    auto_tool_choice: bool = True  # tool_choice auto parses calls out of the answer
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    think: ThinkTokens | None = None  # the reasoning markers' token ids, where single tokens
    specials: frozenset[str] = frozenset()  # the tokenizer's special tokens' texts
    detect: frozenset[str] = frozenset()  # "reasoning", "tools": the flags said auto
    tools_on_none: bool = True  # tool_choice none still shows the template the tools
    request_templates: bool = False  # a request may bring its own chat_template

    def template_for(self, asked: str | None) -> ChatTemplate:
        """The template a request renders with: this setup's, or (where trusted) its own."""
        if asked is None:
            return self.template
        if not self.request_templates:
            raise APIError.bad_request("this server does not take a chat_template per request; "
                                       "leave it out, or start the server with "
                                       "--trust-request-chat-template", param="chat_template")
        return ChatTemplate(asked, self.template.kwargs)

    def reading(self, tools: list[dict] | None, thinking: bool, syntax: str | None = None,
                single_call: bool = False) -> tuple[ChatReading, bool]:
        """(how a request's answers are read, whether it decodes with special tokens kept):
        `tools`, the request's tools when calls are to be parsed out of its answers, in this
        setup's syntax or `syntax`'s; `thinking`, whether its template asked the model to think
        (Qwen3's enable_thinking); `single_call`: parallel_tool_calls false."""
        reasoning = self.reasoning_parser(thinking)
        calls = self.tool_parser(tools, syntax) if tools else None
        markers = set(calls.syntax_tokens if calls else ())
        if reasoning is not None:
            markers |= {reasoning.start_marker, reasoning.end_marker}
        keep = bool(markers & self.specials)
        others = sorted(self.specials - markers, key=len, reverse=True)
        strip = regex.compile("|".join(map(regex.escape, others))) if keep and others else None
        return ChatReading(reasoning, calls, strip, self.think, single_call=single_call), keep

    def reasoning_parser(self, enable_thinking: bool) -> ReasoningParser | None:
        if self.reasoning is None:
            return None
        factory = reasoning_parser(self.reasoning)
        return factory(enable_thinking=enable_thinking) if self.reasoning == "qwen3" else factory()

    def tool_parser(self, tools: list[dict], name: str | None = None) -> ToolCallParser | None:
        """The parser of this setup's call syntax (or `name`'s) for the request's tools."""
        name = name or self.tools
        if name is None:
            return None
        return tool_call_parser(name)(tools=[ToolSpec.from_openai(t) for t in tools])

    def answer_after(self, prompt: list[int]) -> tuple[int, ...]:
        """The tokens after which a structured-output grammar constrains the answer
        (GuidedDecoding.after): the end of thinking, unless the prompt already ended it (a
        template told not to think writes an empty block); () without a reasoning parser."""
        think = self.think
        if self.reasoning is None or think is None:
            return ()
        last_start = max((i for i, t in enumerate(prompt) if t in think.start), default=-1)
        ended = last_start >= 0 and any(t in think.end for t in prompt[last_start + 1:])
        return () if ended else tuple(sorted(think.end))

    def with_think_tokens(self, vocab) -> ChatSetup:
        """The reasoning markers' ids in `vocab` (token -> id), None where not single tokens."""
        if self.reasoning is None or vocab is None:
            return replace(self, think=None)
        try:
            think = self.reasoning_parser(True).think_tokens(vocab)
        except ValueError:
            think = None
        return replace(self, think=think)


def chat_template_text(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it names no file."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read(MAX_TEMPLATE_BYTES + 1)
        if len(text) > MAX_TEMPLATE_BYTES:
            raise ValueError(f"--chat-template {value!r} is larger than {MAX_TEMPLATE_BYTES} bytes")
        return text
    if value.endswith((".jinja", ".j2")) and "{" not in value:
        raise ValueError(f"--chat-template {value!r}: no such file")
    return value


def base_setup(config: ServerConfig, tokenizer) -> ChatSetup:
    """The served model's setup, from the flags and (for `auto`) its chat template."""
    text = chat_template_text(config.chat_template)
    template = ChatTemplate(text, config.chat_template_kwargs())
    source = text or getattr(tokenizer, "chat_template", None) or ""
    reasoning = config.reasoning_parser
    if reasoning == "auto":
        reasoning = reasoning_parser_for_template(source)
        logger.info("reasoning parser: %s (auto, from the chat template)", reasoning or "none")
    tools = config.tool_call_parser
    if tools == "auto":
        tools = tool_parser_for_template(source)
        logger.info("tool-call parser: %s (auto, from the chat template)", tools or "none")
    detect = frozenset(name for name, flag in (("reasoning", config.reasoning_parser),
                                               ("tools", config.tool_call_parser))
                       if flag == "auto")  # an adapter's own template is read the same way
    setup = ChatSetup(template, None if reasoning == "none" else reasoning, tools,
                      config.enable_auto_tool_choice,
                      generation_defaults(config.generation_config, str(config.model)),
                      detect=detect,
                      tools_on_none=not config.exclude_tools_when_tool_choice_none,
                      request_templates=config.trust_request_chat_template)
    if tokenizer is None:
        return setup
    specials = frozenset(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
    return replace(setup, specials=specials).with_think_tokens(tokenizer.get_vocab())


def chat_reading(data: ChatCompletionRequest, setup: ChatSetup,
                 names: list[str] | None) -> tuple[ChatReading, bool, GuidedDecoding | None]:
    """How one request's answers are read, whether it decodes with special tokens kept, and the
    constraint of a forced call (tool_choice required or named: one call, in the served
    model's own syntax). Its thinking is read as its template was asked (Qwen3's
    enable_thinking, from the request over the defaults); its calls where tools are in play:
    a forced call always, any other only with auto tool choice on."""
    kwargs = {**setup.template.kwargs, **(data.chat_template_kwargs or {})}
    thinking = kwargs.get("enable_thinking", True) is not False
    forced = syntax = None
    tools = None
    if names is not None:
        tools = [t for t in data.tools if t.get("function", {}).get("name") in names]
        if data.tool_choice not in (None, "auto"):
            forced, syntax = forced_call(setup.tools, tools, names, "[ARGS]" in setup.specials)
        elif not setup.auto_tool_choice:
            tools = None
    reading, keep = setup.reading(tools, thinking, syntax,
                                  single_call=data.parallel_tool_calls is False)
    return reading, keep, forced
