"""Chat completions in OpenAI's shapes: chunks and whole responses, logprobs, and each answer
read as its family writes it (gateway/openai/chat_reading.py): the thinking in `reasoning` and
`reasoning_content`, the tool calls in `tool_calls`, the rest in `content`, streamed as the
same deltas a whole response gives."""

from __future__ import annotations

from msgspec import UNSET

from loragw.engine.api import RequestOutput, TokenLogprob
from loragw.gateway.http.jobs import Choice, TokenCounts
from loragw.gateway.http.response_bodies import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionTokensDetails,
    Delta,
    FunctionCall,
    TokenLogprobOut,
    ToolCall,
    ToolCallChunk,
    TopLogprob,
    Usage,
)
from loragw.gateway.openai.chat_reading import PLAIN, ChatReading, ChoiceReader, Piece
from loragw.gateway.openai.formats import Format, usage, vllm_prompt_logprobs


class ChatFormat(Format):
    """Each choice's text goes through its own ChoiceReader (`reading`: how this request's
    answers are read; plain content when nothing is to be parsed)."""

    def __init__(self, *args, reading: ChatReading | None = None):
        super().__init__(*args)
        self.reading = reading or PLAIN
        self.readers: dict[int, ChoiceReader] = {}  # choice index -> its reader

    def _read(self, choice: Choice, text: str, token_ids: list[int], finished: bool) -> Piece:
        reader = self.readers.get(choice.index)
        if reader is None:
            reader = self.readers[choice.index] = self.reading.reader(choice.index)
        return reader.feed(text, token_ids, finished)

    def finish_reason(self, choice: Choice) -> str | None:
        """A choice whose text held valid calls and stopped by itself ends with "tool_calls"."""
        reader = self.readers.get(choice.index)
        if reader is not None and reader.called and choice.finish_reason == "stop":
            return "tool_calls"
        return choice.finish_reason

    def usage_chunk(self, counts: TokenCounts):
        return self._chunk([], self._usage(counts))

    def _usage(self, counts: TokenCounts) -> Usage:
        out = usage(counts)
        if self.reading.reasoning is not None:
            out.completion_tokens_details = CompletionTokensDetails(
                sum(r.reasoning_tokens() for r in self.readers.values()))
        return out

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
        piece = self._read(choice, out.new_text, out.new_token_ids, out.finished)
        calls = [ToolCallChunk(index=c.index, id=c.id, type="function" if c.id else None,
                               function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in piece.calls] or None
        reasoning = piece.reasoning or None
        if not piece.content and calls is None and reasoning is None and not (
                logprobs and logprobs.content):
            return None
        content = piece.content if piece.content or not (calls or reasoning) else None
        return self._chunk([ChatChunkChoice(
            choice.index, Delta(content=content, tool_calls=calls, reasoning=reasoning,
                                reasoning_content=reasoning), logprobs)])

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
            piece = self._read(c, "".join(o.new_text for o in outs),
                               [t for o in outs for t in o.new_token_ids], True)
            calls = whole_calls(piece.calls)
            reader = self.readers[c.index]
            thought = piece.reasoning if reader.saw_reasoning else UNSET
            message = AssistantMessage(content=piece.content or (None if calls else ""),
                                       tool_calls=calls or UNSET, reasoning=thought,
                                       reasoning_content=thought)
            out.append(ChatChoice(c.index, message, logprobs, self.finish_reason(c)))
        prompt = next((o.prompt_logprobs for c in choices for o in parts[c.index]
                       if o.prompt_logprobs is not None), None)
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model,
                                      choices=out, usage=self._usage(counts),
                                      prompt_logprobs=vllm_prompt_logprobs(
                                          prompt, self.token_text, self.prompt_logprobs))


def whole_calls(pieces) -> list[ToolCall]:
    """Call pieces joined into whole OpenAI tool calls, in order."""
    calls: list[ToolCall] = []
    for piece in pieces:
        if piece.id is not None:
            calls.append(ToolCall(id=piece.id, type="function",
                                  function=FunctionCall(name=piece.name, arguments="")))
        calls[piece.index].function.arguments += piece.arguments
    return calls
