"""How an endpoint shapes engine increments: SSE chunks for a stream, or one whole response,
in OpenAI's shapes (completions and chat, with logprobs and tool calls). A Format reads a
job's choices and never changes them: the finish reason it shows is its own `finish_reason`."""

from __future__ import annotations

import time

from engine.sequence import RequestOutput, TokenLogprob
from engine.tokenizer import TokenText
from gateway.http.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Delta,
    FunctionCall,
    PromptTokensDetails,
    TokenLogprobOut,
    ToolCall,
    ToolCallChunk,
    TopLogprob,
    Usage,
)
from gateway.http.tool_calls import ToolCallParser, Update
from gateway.jobs import Choice, TokenCounts


def usage(counts: TokenCounts) -> Usage:
    return Usage(prompt_tokens=counts.prompt, completion_tokens=counts.completion,
                 total_tokens=counts.prompt + counts.completion,
                 prompt_tokens_details=PromptTokensDetails(counts.cached))


class Format:
    """How an endpoint shapes increments: chunks for a stream, or one whole response."""

    def __init__(self, response_id: str, model: str, token_text: TokenText, logprobs: bool):
        self.id, self.model, self.token_text = response_id, model, token_text
        self.logprobs = logprobs
        self.created = int(time.time())

    def head(self, choices: list[Choice]) -> list:
        return []

    def delta(self, choice: Choice, out: RequestOutput):
        raise NotImplementedError

    def finish_reason(self, choice: Choice) -> str | None:
        """The finish_reason the client sees for a finished choice."""
        return choice.finish_reason

    def finish(self, choice: Choice):
        raise NotImplementedError

    def usage_chunk(self, counts: TokenCounts):
        """The stream_options.include_usage chunk: no choices, just usage."""
        return self._chunk([], usage(counts))

    def _chunk(self, choices: list, usage: Usage | None = None):
        raise NotImplementedError

    def whole(self, choices: list[Choice], parts: dict[int, list[RequestOutput]],
              counts: TokenCounts):
        raise NotImplementedError


class CompletionFormat(Format):
    """With `echo` (each prompt's text, by prompt index), a choice's text starts with its
    prompt's: a stream sends it as the choice's first chunk, before any generated text."""

    def __init__(self, *args, echo: list[str] | None = None):
        super().__init__(*args)
        self.echo = echo
        self.offsets: dict[int, int] = {}  # text_offset of each choice's next token

    def _logprobs(self, index: int, entries: list[TokenLogprob]) -> CompletionLogprobs:
        text = self.token_text
        tokens = [text(e.token_id) for e in entries]
        offsets, at = [], self.offsets.get(index, 0)
        for token in tokens:
            offsets.append(at)
            at += len(token)
        self.offsets[index] = at
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[e.logprob for e in entries],
            top_logprobs=[{text(t): lp for t, lp in e.top} for e in entries], text_offset=offsets)

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None):
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  choices=choices, usage=usage)

    def head(self, choices: list[Choice]) -> list:
        if self.echo is None:
            return []
        return [self._chunk([CompletionChoice(c.index, self.echo[c.prompt_index], None, None)])
                for c in choices]

    def delta(self, choice: Choice, out: RequestOutput):
        logprobs = self._logprobs(choice.index, out.new_logprobs) if self.logprobs else None
        if not out.new_text and not (logprobs and logprobs.tokens):
            return None
        return self._chunk([CompletionChoice(choice.index, out.new_text, logprobs, None)])

    def finish(self, choice: Choice):
        return self._chunk([CompletionChoice(choice.index, "", None, self.finish_reason(choice))])

    def whole(self, choices: list[Choice], parts: dict[int, list[RequestOutput]],
              counts: TokenCounts):
        out = []
        for c in choices:
            outs = parts[c.index]
            logprobs = (self._logprobs(c.index, [e for o in outs for e in o.new_logprobs])
                        if self.logprobs else None)
            prefix = self.echo[c.prompt_index] if self.echo is not None else ""
            out.append(CompletionChoice(c.index, prefix + "".join(o.new_text for o in outs),
                                        logprobs, self.finish_reason(c)))
        return self._chunk(out, usage(counts))


class ChatFormat(Format):
    """With `tool_names` (tools in play), each choice's text goes through a ToolCallParser:
    a call streams as OpenAI tool_call deltas (header, then argument fragments) as soon as the
    text shows it is one, and anything else as content."""

    def __init__(self, *args, tool_names: list[str] | None = None):
        super().__init__(*args)
        self.tool_names = tool_names
        self.parsers: dict[int, ToolCallParser] = {}  # choice index -> its parser (tool mode)

    def _tools(self, choice: Choice, text: str, finished: bool) -> Update:
        """Content and call pieces of a choice's next text (and, once finished, the rest)."""
        parser = self.parsers.setdefault(choice.index, ToolCallParser(self.tool_names))
        update = parser.feed(text)
        if finished:
            update += parser.finish()
        return update

    def finish_reason(self, choice: Choice) -> str | None:
        """A choice whose text held valid calls and stopped by itself ends with "tool_calls"."""
        parser = self.parsers.get(choice.index)
        if parser is not None and parser.called and choice.finish_reason == "stop":
            return "tool_calls"
        return choice.finish_reason

    def _logprobs(self, entries: list[TokenLogprob]) -> ChatLogprobs:
        text = self.token_text

        def top(token_id: int, logprob: float) -> TopLogprob:
            token = text(token_id)
            return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

        return ChatLogprobs(content=[
            TokenLogprobOut(token=text(e.token_id), logprob=e.logprob,
                            bytes=list(text(e.token_id).encode()),
                            top_logprobs=[top(t, lp) for t, lp in e.top]) for e in entries])

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None):
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=choices, usage=usage)

    def head(self, choices: list[Choice]) -> list:
        return [self._chunk([ChatChunkChoice(c.index, Delta(role="assistant", content=""))])
                for c in choices]

    def delta(self, choice: Choice, out: RequestOutput):
        logprobs = self._logprobs(out.new_logprobs) if self.logprobs else None
        content, calls = out.new_text, None
        if self.tool_names:
            update = self._tools(choice, out.new_text, out.finished)
            content = update.content
            calls = [ToolCallChunk(index=p.index, id=p.id, type="function" if p.id else None,
                                   function=FunctionCall(name=p.name, arguments=p.arguments))
                     for p in update.calls] or None
        if not content and calls is None and not (logprobs and logprobs.content):
            return None
        return self._chunk([ChatChunkChoice(
            choice.index, Delta(content=(content or None) if calls else content, tool_calls=calls),
            logprobs)])

    def finish(self, choice: Choice):
        return self._chunk([ChatChunkChoice(choice.index, Delta(), None,
                                            self.finish_reason(choice))])

    def whole(self, choices: list[Choice], parts: dict[int, list[RequestOutput]],
              counts: TokenCounts):
        out = []
        for c in choices:
            outs = parts[c.index]
            logprobs = (self._logprobs([e for o in outs for e in o.new_logprobs])
                        if self.logprobs else None)
            text = "".join(o.new_text for o in outs)
            message = AssistantMessage(content=text)
            if self.tool_names:
                update = self._tools(c, text, finished=True)
                calls = whole_calls(update)
                message = AssistantMessage(content=update.content or (None if calls else ""),
                                           tool_calls=calls or None)
            out.append(ChatChoice(c.index, message, logprobs, self.finish_reason(c)))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model,
                                      choices=out, usage=usage(counts))


def whole_calls(update: Update) -> list[ToolCall]:
    """Call pieces joined into whole OpenAI tool calls, in order."""
    calls: list[ToolCall] = []
    for piece in update.calls:
        if piece.id is not None:
            calls.append(ToolCall(id=piece.id, type="function",
                                  function=FunctionCall(name=piece.name, arguments="")))
        calls[piece.index].function.arguments += piece.arguments
    return calls
