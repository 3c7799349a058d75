"""What a chat response says, whole or streamed (`whole`, `joined`: the same Reply for the same
answer), and whether it says what a trained Answer should read as (`assert_answers`).

    reply = ask(client, "qwen3", PROMPTS["call"], stream=True)
    assert_answers(reply, model.answers["call"], "qwen3")
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

import jsonschema
from chat_families import FAMILIES
from family_models import FORECAST_TOOL, Answer, Prompt

MAX_TOKENS = 100  # every trained answer is shorter: a model that wanders stops here


def ask(client, model: str, prompt: Prompt, stream: bool, **extra) -> Reply:
    """The answer of `model` to `prompt` (its tools, its chat_template_kwargs) at temperature
    0, whole or joined from a stream; `extra`: other request fields (max_tokens=openai.omit
    leaves it out)."""
    body = {"chat_template_kwargs": prompt.kwargs} if prompt.kwargs else None
    kwargs = dict(model=model, messages=list(prompt.messages), temperature=0,
                  max_tokens=MAX_TOKENS, extra_body=body) | extra
    if prompt.tools:
        kwargs["tools"] = list(prompt.tools)
    if stream:
        chunks = client.chat.completions.create(**kwargs, stream=True,
                                                stream_options={"include_usage": True})
        return joined(list(chunks))
    return whole(client.chat.completions.create(**kwargs))


@dataclass(frozen=True)
class Reply:
    content: str  # "" for none
    reasoning: str | None  # None: the response has no reasoning field
    reasoning_content: str | None
    calls: tuple[tuple[str, str], ...]  # (name, arguments)
    ids: tuple[str, ...]
    finish_reason: str | None
    reasoning_tokens: int | None

    def without_ids(self) -> Reply:
        return replace(self, ids=())


def extra(obj, key: str):
    """A field the openai client's types do not declare (vLLM's `reasoning`)."""
    return (obj.model_extra or {}).get(key, getattr(obj, key, None))


def reasoning_tokens(usage) -> int | None:
    details = usage.completion_tokens_details if usage is not None else None
    return details.reasoning_tokens if details is not None else None


def whole(response) -> Reply:
    (choice,) = response.choices
    message = choice.message
    calls = message.tool_calls or []
    assert all(c.type == "function" for c in calls), calls
    return Reply(message.content or "", extra(message, "reasoning"),
                 extra(message, "reasoning_content"),
                 tuple((c.function.name, c.function.arguments) for c in calls),
                 tuple(c.id for c in calls), choice.finish_reason,
                 reasoning_tokens(response.usage))


def joined(chunks) -> Reply:
    """The stream's deltas put together; each call's id and name come once, in its first
    piece, and its arguments after."""
    content, reasoning, reasoning_content = "", None, None
    calls: list[dict] = []
    finish, usage = None, None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            assert choice.index == 0
            delta = choice.delta
            content += delta.content or ""
            if (piece := extra(delta, "reasoning")) is not None:
                reasoning = (reasoning or "") + piece
            if (piece := extra(delta, "reasoning_content")) is not None:
                reasoning_content = (reasoning_content or "") + piece
            for call in delta.tool_calls or []:
                if call.id is not None:
                    assert call.index == len(calls) and call.function.name, call
                    calls.append({"id": call.id, "name": call.function.name,
                                  "arguments": call.function.arguments or ""})
                else:
                    assert call.index == len(calls) - 1 and not call.function.name, call
                    calls[-1]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return Reply(content, reasoning, reasoning_content,
                 tuple((c["name"], c["arguments"]) for c in calls),
                 tuple(c["id"] for c in calls), finish, reasoning_tokens(usage))


def assert_answers(reply: Reply, expected: Answer, family: str) -> None:
    """`reply` says what the trained `expected` answer should read as, in `family`'s syntax."""
    where = f"{family}: {reply}"
    assert reply.content.strip() == (expected.content or ""), where
    if expected.reasoning is None:
        assert reply.reasoning is None and reply.reasoning_content is None, where
        assert not reply.reasoning_tokens, where
    else:
        assert reply.reasoning is not None and reply.reasoning.strip() == expected.reasoning, where
        assert reply.reasoning_content == reply.reasoning, where
        assert reply.reasoning_tokens and reply.reasoning_tokens > 0, where
    assert [name for name, _ in reply.calls] == ["get_weather"] * len(expected.calls), where
    for (_, arguments), wanted in zip(reply.calls, expected.calls, strict=True):
        value = json.loads(arguments)
        jsonschema.validate(value, FORECAST_TOOL["function"]["parameters"])
        assert value == wanted, where
    assert len(set(reply.ids)) == len(reply.ids) and all(reply.ids), where
    if FAMILIES[family].tool_parser == "mistral":  # what Mistral's templates take back
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in reply.ids), where
    assert reply.finish_reason == ("tool_calls" if expected.calls else "stop"), where
