"""Request bodies -> token ids: completion prompts (text or token ids, one or many), chat
messages through the chat template, and what `echo` shows back. Long texts are tokenized on a
worker thread so the event loop keeps serving, a few at a time, and only as far as they can fit
the context window (prompt_bounds.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import msgspec

from loragw.engine.api import ChatTemplate, InvalidParam, render_chat
from loragw.gateway.common.errors import APIError
from loragw.gateway.openai.chat_setup import ChatSetup
from loragw.gateway.openai.prompt_bounds import ContextBound, encode_bounded, tokenizing_cap
from loragw.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

# Prompts whose text is longer than this are tokenized on a worker thread, not the event loop.
TOKENIZE_INLINE_MAX_CHARS = 16_384
T = TypeVar("T")


def completion_prompts(data: CompletionRequest, tokenizer,
                       bound: ContextBound) -> list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> one token-id list per prompt (the
    engine checks token ids against its vocabulary when they are queued); a text that cannot
    fit `bound` is refused before it is tokenized whole."""
    prompt = data.prompt
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    elif prompt and (all(isinstance(p, str) for p in prompt)
                     or all(isinstance(p, list) for p in prompt)):
        items = list(prompt)
    else:
        raise APIError.bad_request("prompt must be a string, a list of strings, a list of token "
                                   "ids or a list of token-id lists (not empty, not mixed)",
                                   param="prompt")
    if tokenizer is None and any(isinstance(item, str) for item in items):
        raise APIError.bad_request("this model has no tokenizer; pass prompts as token-id "
                                   "lists", param="prompt")
    return [encode_bounded(tokenizer, item, bound) if isinstance(item, str) else list(item)
            for item in items]


def prompt_texts(data: CompletionRequest, prompts: list[list[int]], tokenizer) -> list[str]:
    """What echo shows of each prompt: the text sent, or the token ids sent, decoded."""
    if isinstance(data.prompt, str):
        return [data.prompt]
    if all(isinstance(p, str) for p in data.prompt):
        return list(data.prompt)
    if tokenizer is None:
        return [""] * len(prompts)  # no text at all without a tokenizer, outputs included
    return [tokenizer.decode(ids, skip_special_tokens=data.skip_special_tokens)
            for ids in prompts]


def chat_prompt(data: ChatCompletionRequest, tokenizer, setup: ChatSetup,
                bound: ContextBound) -> list[int]:
    """The chat request's messages rendered by the template of `setup` (the served model's or
    adapter's) or the request's own, as transformers renders them
    (engine/request/chat_template.py), then encoded without special tokens (the template
    writes them) unless the rendered text cannot fit `bound`."""
    if any(isinstance(m.content, list) and any(p.type != "text" or p.text is None
                                               for p in m.content) for m in data.messages):
        raise APIError.not_supported("content parts other than text", "messages")
    if tokenizer is None:
        raise APIError.bad_request("this model has no tokenizer; use /v1/completions with "
                                   "token-id prompts", param="messages")
    template = setup.template_for(data.chat_template)
    tools = data.tools if data.tool_choice != "none" or setup.tools_on_none else None
    try:
        text = render_chat(tokenizer, [msgspec.to_builtins(m) for m in data.messages],
                           template=template or ChatTemplate(), tools=tools or None,
                           kwargs=data.chat_template_kwargs,
                           add_generation_prompt=data.add_generation_prompt,
                           continue_final_message=data.continue_final_message)
    except InvalidParam as exc:
        raise APIError.from_engine(exc) from None
    except ValueError as exc:  # no template at all
        raise APIError.bad_request(str(exc), param="messages") from None
    return encode_bounded(tokenizer, text, bound, add_special_tokens=False)


async def off_loop_if_large(render: Callable[[SamplingRequest, object], T],
                            data: SamplingRequest, tokenizer) -> T:
    """render(data, tokenizer), on a worker thread when the text is long enough to stall the
    event loop (fast tokenizers encode and decode concurrently without trouble), under the
    loop's cap on tokenizations at once."""
    if _text_size(data) <= TOKENIZE_INLINE_MAX_CHARS:
        return render(data, tokenizer)
    async with tokenizing_cap():
        return await asyncio.to_thread(render, data, tokenizer)


def _text_size(data: SamplingRequest) -> int:
    if isinstance(data, ChatCompletionRequest):
        return sum(len(m.content) if isinstance(m.content, str) else
                   sum(len(p.text or "") for p in m.content or []) for m in data.messages)
    prompt = data.prompt
    return len(prompt) if isinstance(prompt, str) else sum(
        len(p) if isinstance(p, str | list) else 1 for p in prompt)
