"""How /v1/responses shapes a job's one choice: output items (a message, function calls) in a
response object, or OpenAI's typed stream events, framed `event: <type>\\ndata: {...}`, numbered,
and with no `data: [DONE]` at the end.

    head      response.created, response.in_progress
    thinking  response.output_item.added (a reasoning item), then
              response.reasoning_text.delta per increment
    text      response.output_item.added (a message), response.content_part.added,
              then response.output_text.delta per increment
    a call    response.output_item.added (a function_call), then
              response.function_call_arguments.delta per fragment
    an item   ends when the next one starts, or at the finish: response.output_text.done,
              response.content_part.done (a message), response.function_call_arguments.done
              (a call) or response.reasoning_text.done, then response.output_item.done
    finish    response.completed, response.incomplete (max_output_tokens) or response.failed
    failure   an `error` event, then response.failed

The stream and the whole response build the same items the same way (`_apply`), so a
stream's last event carries the response a whole request would have returned.
"""

from __future__ import annotations

import uuid

import msgspec

from loragw.engine.api import RequestOutput, TokenText
from loragw.gateway.http.jobs import Choice, TokenCounts
from loragw.gateway.openai.chat_reading import PLAIN, ChatReading, Piece
from loragw.gateway.openai.formats import Format
from loragw.gateway.responses.protocol import (
    ContentPartAdded,
    ContentPartDone,
    ErrorEvent,
    Event,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseError,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseObject,
    ResponseUsage,
)

ABORTED = ("generation stopped before it finished: the server is shutting down or the adapter "
           "was unloaded; retry the request")
_encoder = msgspec.json.Encoder()


class ResponsesFormat(Format):
    """`template`: the response object as it starts (the request's settings echoed, no output);
    the choice's text is read as in chat (`reading`: its thinking, then its calls)."""

    def __init__(self, template: ResponseObject, token_text: TokenText,
                 reading: ChatReading | None = None):
        super().__init__(template.id, template.model, token_text, logprobs=False)
        self.template = template
        self.reader = (reading or PLAIN).reader(0)
        self.items: list[ReasoningItem | OutputMessage | FunctionCallItem] = []  # last: open
        self.sequence = 0  # the next event's sequence_number

    # ---- Format -------------------------------------------------------------------------
    def head(self, choices: list[Choice]) -> list:
        start = self._response("in_progress")
        return [ResponseCreated(response=start), ResponseInProgress(response=start)]

    def delta(self, choice: Choice, out: RequestOutput) -> list[Event] | None:
        return self._apply(self.reader.feed(out.new_text, out.new_token_ids, out.finished)) or None

    def finish(self, choice: Choice) -> list[Event]:
        counts = TokenCounts(choice.num_prompt_tokens, choice.num_output_tokens,
                             choice.num_cached_tokens)
        events, response = self._end(choice, counts)
        terminal = {"completed": ResponseCompleted, "incomplete": ResponseIncomplete}.get(
            response.status, ResponseFailed)
        return [*events, terminal(response=response)]

    def whole(self, choices: list[Choice], parts: dict[int, list[RequestOutput]],
              counts: TokenCounts) -> ResponseObject:
        (choice,) = choices
        outs = parts[choice.index]
        self._apply(self.reader.feed("".join(o.new_text for o in outs),
                                     [t for o in outs for t in o.new_token_ids], True))
        return self._end(choice, counts)[1]

    # ---- framing ------------------------------------------------------------------------
    def encode(self, chunk: Event | list[Event]) -> bytes:
        frames = []
        for event in chunk if isinstance(chunk, list) else [chunk]:
            event.sequence_number, self.sequence = self.sequence, self.sequence + 1
            kind = event.__struct_config__.tag.encode()
            frames.append(b"event: " + kind + b"\ndata: " + _encoder.encode(event) + b"\n\n")
        return b"".join(frames)

    def failure(self, message: str) -> list[Event]:
        return [ErrorEvent(code="server_error", message=message),
                ResponseFailed(response=self._response(
                    "failed", error=ResponseError("server_error", message)))]

    def end(self) -> bytes:
        return b""  # OpenAI's Responses streams end after their last event

    # ---- items --------------------------------------------------------------------------
    def _apply(self, update: Piece) -> list[Event]:
        """The items' next pieces, in the order the text holds them (thinking, then calls and
        content) and the events that show them."""
        events: list[Event] = []
        if update.reasoning:
            item = self._reasoning(events)
            item.content[0].text += update.reasoning
            events.append(ReasoningTextDelta(item_id=item.id, output_index=len(self.items) - 1,
                                             content_index=0, delta=update.reasoning))
        for piece in update.calls:
            if piece.id is not None:  # a call's header: a new function_call item
                events += self._close("completed")
                events += self._open(FunctionCallItem(
                    id=f"fc_{uuid.uuid4().hex}", call_id=piece.id, name=piece.name,
                    arguments="", status="in_progress"))
                continue
            call = self.items[-1]
            assert isinstance(call, FunctionCallItem) and call.status == "in_progress"
            call.arguments += piece.arguments
            events.append(FunctionCallArgumentsDelta(item_id=call.id, delta=piece.arguments,
                                                     output_index=len(self.items) - 1))
        if update.content:
            message = self._message(events)
            message.content[0].text += update.content
            events.append(OutputTextDelta(item_id=message.id, output_index=len(self.items) - 1,
                                          content_index=0, delta=update.content))
        return events

    def _reasoning(self, events: list[Event]) -> ReasoningItem:
        """The open reasoning item, or a new one."""
        last = self.items[-1] if self.items else None
        if isinstance(last, ReasoningItem) and last.status == "in_progress":
            return last
        events += self._close("completed")
        item = ReasoningItem(id=f"rs_{uuid.uuid4().hex}", status="in_progress",
                             content=[ReasoningText("")])
        events += self._open(item)
        return item

    def _message(self, events: list[Event]) -> OutputMessage:
        """The open message, or a new one (closing an open call)."""
        last = self.items[-1] if self.items else None
        if isinstance(last, OutputMessage) and last.status == "in_progress":
            return last
        events += self._close("completed")
        message = OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress", content=[])
        events += self._open(message)
        message.content.append(OutputText(""))
        events.append(ContentPartAdded(item_id=message.id, output_index=len(self.items) - 1,
                                       content_index=0, part=OutputText("")))
        return message

    def _open(self, item: OutputMessage | FunctionCallItem) -> list[Event]:
        self.items.append(item)
        # the added event shows the item as it starts, not as it is by the time it is encoded
        start = (msgspec.structs.replace(item, content=[]) if isinstance(item, OutputMessage)
                 else msgspec.structs.replace(item, content=[ReasoningText("")])
                 if isinstance(item, ReasoningItem) else msgspec.structs.replace(item))
        return [OutputItemAdded(output_index=len(self.items) - 1, item=start)]

    def _close(self, status: str) -> list[Event]:
        """End the open item, if there is one, with `status` (completed or incomplete)."""
        item = self.items[-1] if self.items else None
        if item is None or item.status != "in_progress":
            return []
        item.status, index = status, len(self.items) - 1
        if isinstance(item, FunctionCallItem):
            done: list[Event] = [FunctionCallArgumentsDone(item_id=item.id, output_index=index,
                                                           arguments=item.arguments)]
        elif isinstance(item, ReasoningItem):
            done = [ReasoningTextDone(item_id=item.id, output_index=index, content_index=0,
                                      text=item.content[0].text)]
        else:
            part = item.content[0]
            done = [OutputTextDone(item_id=item.id, output_index=index, content_index=0,
                                   text=part.text),
                    ContentPartDone(item_id=item.id, output_index=index, content_index=0,
                                    part=part)]
        return [*done, OutputItemDone(output_index=index, item=item)]

    def _end(self, choice: Choice, counts: TokenCounts) -> tuple[list[Event], ResponseObject]:
        """The finish: the last item closed, and the response as it ends."""
        reason = choice.finish_reason
        status = {"length": "incomplete", "abort": "failed"}.get(reason or "", "completed")
        events: list[Event] = []
        if not any(isinstance(i, OutputMessage | FunctionCallItem) for i in self.items):
            self._message(events)  # always an output message, empty if nothing was said
        events += self._close("completed" if status == "completed" else "incomplete")
        return events, self._response(
            status, counts,
            IncompleteDetails("max_output_tokens") if status == "incomplete" else None,
            ResponseError("server_error", ABORTED) if status == "failed" else None)

    def _response(self, status: str, counts: TokenCounts | None = None,
                  incomplete: IncompleteDetails | None = None,
                  error: ResponseError | None = None) -> ResponseObject:
        usage = None if counts is None else ResponseUsage(
            input_tokens=counts.prompt, input_tokens_details=InputTokensDetails(counts.cached),
            output_tokens=counts.completion,
            output_tokens_details=OutputTokensDetails(self.reader.reasoning_tokens()),
            total_tokens=counts.prompt + counts.completion)
        return msgspec.structs.replace(self.template, status=status, output=list(self.items),
                                       usage=usage, incomplete_details=incomplete, error=error)
