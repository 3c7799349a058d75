"""Request bodies -> token ids: completion prompts (text or token ids, one or many), chat
messages through the chat template, and what `echo` shows back. Long texts are tokenized on a
worker thread so the event loop keeps serving."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from loragw.engine.request.tokenizer import encode_chat, tokenize
from loragw.gateway.errors import APIError
from loragw.gateway.http.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

# Prompts whose text is longer than this are tokenized on a worker thread, not the event loop.
TOKENIZE_INLINE_MAX_CHARS = 16_384
T = TypeVar("T")


def completion_prompts(data: CompletionRequest, tokenizer) -> list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> one token-id list per prompt (the
    engine checks token ids against its vocabulary when they are queued)."""
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
    try:
        return [tokenize(tokenizer, item) for item in items]
    except ValueError as exc:
        raise APIError.bad_request(str(exc), param="prompt") from None


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


def chat_prompt(data: ChatCompletionRequest, tokenizer) -> list[int]:
    messages = []
    for m in data.messages:
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise APIError.not_supported("content parts other than text", "messages")
            content = "\n".join(part.text for part in content)
        message = {"role": "system" if m.role == "developer" else m.role,
                   "content": content or ""}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        messages.append(message)
    if tokenizer is None:
        raise APIError.bad_request("this model has no tokenizer; use /v1/completions with "
                                   "token-id prompts", param="messages")
    try:
        tools = data.tools if data.tool_choice != "none" else None
        return encode_chat(tokenizer, messages, tools=tools or None)
    except Exception as exc:  # ValueError (no template) or a template that raised
        raise APIError.bad_request(f"the chat template could not render these messages: "
                                   f"{exc}", param="messages") from None


async def off_loop_if_large(render: Callable[[SamplingRequest, object], T],
                            data: SamplingRequest, tokenizer) -> T:
    """render(data, tokenizer), on a worker thread when the text is long enough to stall the
    event loop (fast tokenizers encode and decode concurrently without trouble)."""
    if _text_size(data) <= TOKENIZE_INLINE_MAX_CHARS:
        return render(data, tokenizer)
    return await asyncio.to_thread(render, data, tokenizer)


def _text_size(data: SamplingRequest) -> int:
    if isinstance(data, ChatCompletionRequest):
        return sum(len(m.content) if isinstance(m.content, str) else
                   sum(len(p.text or "") for p in m.content or []) for m in data.messages)
    prompt = data.prompt
    return len(prompt) if isinstance(prompt, str) else sum(
        len(p) if isinstance(p, str | list) else 1 for p in prompt)
