"""A chat request rendered by its chat template the way transformers' `apply_chat_template`
renders it, with what real templates expect of the messages (vLLM's rules):

    a tool result         keeps `tool_call_id` and `name` (Mistral's template refuses a result
                          without the id, Hermes' without the name)
    an assistant's calls  `tool_calls[i].function.arguments` parsed from its JSON string into an
                          object, since templates apply `| tojson` to it (else the prompt holds
                          the arguments encoded twice); a template that pastes them in as text
                          (DeepSeek-R1's `+ arguments +`) and so fails on objects is rendered
                          again with the strings
    earlier reasoning     an assistant's `reasoning` / `reasoning_content` under both names, for
                          the templates that show or drop it
    a `developer` turn    as `system`; text content parts joined
and the request's `chat_template_kwargs` (over the served model's defaults, e.g. Qwen3's
`enable_thinking`), `add_generation_prompt` and `continue_final_message`. The template is the
served model's, an adapter's own, or `--chat-template`'s (ChatTemplate). A template that raises
(`raise_exception`) is a TemplateRefused naming its message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loragw.engine.request.params import InvalidParam

# Keys a request's chat_template_kwargs may not set: what the renderer passes itself.
RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                             "add_generation_prompt", "continue_final_message", "tokenize",
                             "return_dict", "tokenizer"})


class TemplateRefused(InvalidParam):
    """The chat template raised (a message it refuses, a role out of order)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template: its Jinja source (None: the tokenizer's own) and the kwargs every
    request renders with unless it sets them (`--default-chat-template-kwargs`)."""

    source: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)


def conversation(messages: Sequence[Mapping[str, Any]],
                 arguments_as_objects: bool = True) -> list[dict[str, Any]]:
    """OpenAI messages (as dicts, None values left out) as the templates read them."""
    out = []
    for m in messages:
        message = {k: v for k, v in m.items() if v is not None}
        if message.get("role") == "developer":
            message["role"] = "system"
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = "\n".join(part.get("text") or "" for part in content)
        reasoning = message.get("reasoning", message.get("reasoning_content"))
        if reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        if message.get("tool_calls") and arguments_as_objects:
            message["tool_calls"] = [_call_for_template(c) for c in message["tool_calls"]]
        out.append(message)
    return out


def _call_for_template(call: Mapping[str, Any]) -> dict[str, Any]:
    call = dict(call)
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            function["arguments"] = parsed
    call["function"] = function
    return call


def render_chat(tokenizer, messages: Sequence[Mapping[str, Any]], *,
                template: ChatTemplate = ChatTemplate(),
                tools: list[dict[str, Any]] | None = None,
                kwargs: Mapping[str, Any] | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> str:
    """The prompt text; InvalidParam for flags that cannot go together, TemplateRefused for
    what the template refuses, ValueError when there is no template at all."""
    kwargs = dict(kwargs or {})
    if bad := sorted(RESERVED_KWARGS & set(kwargs)):
        raise InvalidParam("chat_template_kwargs", f"chat_template_kwargs may not set {bad}: "
                           "they are request fields of their own")
    if add_generation_prompt and continue_final_message:
        raise InvalidParam("continue_final_message", "continue_final_message and "
                           "add_generation_prompt cannot both be true; set "
                           "add_generation_prompt to false to continue the last message")
    turns = conversation(messages)
    if continue_final_message and (not turns or turns[-1].get("role") != "assistant"):
        raise InvalidParam("continue_final_message", "continue_final_message continues the "
                           "last message, which must be the assistant's")
    source = template.source or getattr(tokenizer, "chat_template", None)
    if not source:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; use a chat "
                         "(instruct) model, serve it with --chat-template, or send a plain "
                         "completion request instead")
    def render(turns: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(
            turns, tools=tools, chat_template=source, tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **{**template.kwargs, **kwargs})

    try:
        try:
            text = render(turns)
        except Exception:
            as_text = conversation(messages, arguments_as_objects=False)
            if as_text == turns:  # no arguments were parsed: the template refuses as it is
                raise
            text = render(as_text)  # it pastes the arguments in as text
    except Exception as exc:  # jinja2's TemplateError from raise_exception, a missing key
        raise TemplateRefused("messages", f"the chat template refused these messages: "
                              f"{exc}") from None
    assert isinstance(text, str), type(text)
    return text
