"""Each adapter's chat: the base's ChatSetup, with what the adapter brings over it
(adapters/chat_files.py's AdapterChat: its template, parser names, generation_config.json).

Checked once, before the adapter is stored (`check`, which residency calls through the
ChatCheck it is handed): parser names the engine knows, a generation config it reads, a
template that renders a one-message chat, and no token its tokenizer adds that the base's
vocabulary lacks (its embeddings would have no row for it). Built once per distinct
AdapterChat (`setup`), so one adapter's requests never re-read its template. Where the flags
said `auto`, an adapter's own template picks its parsers as the base's did; "none" turns the
base's parser off for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from loragw.adapters.chat_files import AdapterChat
from loragw.adapters.errors import AdapterError
from loragw.engine.api import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ChatTemplate,
    InvalidParam,
    parse_generation_config,
    reasoning_parser_for_template,
    render_chat,
    tool_parser_for_template,
)
from loragw.gateway.openai.chat_setup import ChatSetup

PROBE = [{"role": "user", "content": "hello"}]  # what every template must render
NONE = "none"


class AdapterChats:
    """`AdapterChats(base, tokenizer)`: the served model's setup and its tokenizer."""

    def __init__(self, base: ChatSetup, tokenizer):
        self.base, self.tokenizer = base, tokenizer
        self.vocab: Mapping[str, int] | None = tokenizer.get_vocab() if tokenizer else None
        self._setups: dict[AdapterChat, ChatSetup] = {AdapterChat(): base}

    def setup(self, chat: AdapterChat | None) -> ChatSetup:
        """How a model with `chat` (None or empty: the base) speaks chat."""
        chat = chat or AdapterChat()
        found = self._setups.get(chat)
        if found is None:
            found = self._setups[chat] = self._build(chat)
        return found

    def check(self, chat: AdapterChat, added: tuple[str, ...]) -> None:
        """AdapterError (422) naming what the gateway could not serve of `chat`; `added`: the
        tokens the adapter's tokenizer adds."""
        for field, name, known in (("reasoning_parser", chat.reasoning_parser, REASONING_PARSERS),
                                   ("tool_call_parser", chat.tool_call_parser, TOOL_CALL_PARSERS)):
            if name and name != NONE and name not in known:
                raise AdapterError(f"{field} {name!r} is not one of: "
                                   f"{', '.join((NONE, *known))}")
        if self.vocab is not None and (missing := [t for t in added if t not in self.vocab]):
            raise AdapterError(f"the adapter's tokenizer adds tokens the base model's "
                               f"vocabulary lacks: {', '.join(map(repr, missing[:8]))}"
                               f"{' ...' if len(missing) > 8 else ''}; train it without new "
                               "tokens, or serve a base whose tokenizer has them")
        setup = self._build(chat)
        if chat.template and self.tokenizer is not None:
            try:
                render_chat(self.tokenizer, PROBE, template=setup.template)
            except (InvalidParam, ValueError) as exc:
                raise AdapterError(f"the adapter's chat template does not render a one-message "
                                   f"chat: {exc}") from None
        self._setups.setdefault(chat, setup)

    def _build(self, chat: AdapterChat) -> ChatSetup:
        base = self.base
        generation = base.generation
        if chat.generation_config:
            try:
                generation = parse_generation_config(chat.generation_config,
                                                     "the adapter's generation_config.json")
            except ValueError as exc:
                raise AdapterError(str(exc)) from None
            generation = generation.over(base.generation)
        template = (ChatTemplate(chat.template, base.template.kwargs) if chat.template
                    else base.template)
        reasoning = _named(chat.reasoning_parser, base.reasoning, chat.template,
                           reasoning_parser_for_template, "reasoning" in base.detect)
        tools = _named(chat.tool_call_parser, base.tools, chat.template,
                       tool_parser_for_template, "tools" in base.detect)
        return replace(base, template=template, reasoning=reasoning, tools=tools,
                       generation=generation).with_think_tokens(self.vocab)


def _named(name: str, base: str | None, template: str, detect, auto: bool) -> str | None:
    """An adapter's parser: its own name; else, with its own template under an `auto` flag,
    the one its template reads as; else the base's."""
    if name:
        return None if name == NONE else name
    if template and auto:
        return detect(template)
    return base
