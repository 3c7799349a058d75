"""Chat completions in OpenAI's shapes: chunks and whole responses, logprobs, and tool calls
parsed out of the text as it streams."""

from __future__ import annotations

from msgspec import UNSET

from loragw.engine.request.sequence import RequestOutput, TokenLogprob
from loragw.gateway.http.formats import Format, usage, vllm_prompt_logprobs
from loragw.gateway.http.response_bodies import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    Delta,
    FunctionCall,
    TokenLogprobOut,
    ToolCall,
    ToolCallChunk,
    TopLogprob,
    Usage,
)
from loragw.gateway.http.tool_calls import ToolCallParser, Update
from loragw.gateway.jobs import Choice, TokenCounts


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

    def _logprobs(self, entries: list[TokenLogprob],
                  refusal: list[TokenLogprobOut] | None = None) -> ChatLogprobs:
        """`refusal`: [] in a stream chunk, whose schema has no null there."""
        text = self.token_text

        def top(token_id: int, logprob: float) -> TopLogprob:
            token = text(token_id)
            return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

        return ChatLogprobs(content=[
            TokenLogprobOut(token=text(e.token_id), logprob=e.logprob,
                            bytes=list(text(e.token_id).encode()),
                            top_logprobs=[top(t, lp) for t, lp in e.top]) for e in entries],
            refusal=refusal)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None):
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   choices=choices, usage=usage)

    def head(self, choices: list[Choice]) -> list:
        return [self._chunk([ChatChunkChoice(c.index, Delta(role="assistant", content=""))])
                for c in choices]

    def delta(self, choice: Choice, out: RequestOutput):
        logprobs = self._logprobs(out.new_logprobs, refusal=[]) if self.logprobs else None
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
                                           tool_calls=calls or UNSET)
            out.append(ChatChoice(c.index, message, logprobs, self.finish_reason(c)))
        prompt = next((o.prompt_logprobs for c in choices for o in parts[c.index]
                       if o.prompt_logprobs is not None), None)
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model,
                                      choices=out, usage=usage(counts),
                                      prompt_logprobs=vllm_prompt_logprobs(
                                          prompt, self.token_text, self.prompt_logprobs))


def whole_calls(update: Update) -> list[ToolCall]:
    """Call pieces joined into whole OpenAI tool calls, in order."""
    calls: list[ToolCall] = []
    for piece in update.calls:
        if piece.id is not None:
            calls.append(ToolCall(id=piece.id, type="function",
                                  function=FunctionCall(name=piece.name, arguments="")))
        calls[piece.index].function.arguments += piece.arguments
    return calls
