"""The Responses API's bodies (POST /v1/responses), as msgspec Structs: the request, the response
object with its output items, and the typed stream events.

Output items and events are tagged by their `type` (the response by its `object`), so each one
encodes with it. The response echoes the request's settings, as OpenAI's does: the `openai`
client's Response model requires `tools`, `tool_choice` and `parallel_tool_calls`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from msgspec import Meta, Struct

from loragw.gateway.openai.protocol import PositiveInt


# ---- the request ---------------------------------------------------------------------------
class Reasoning(Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """`effort` "none" turns a thinking model's reasoning off (its template's enable_thinking);
    any other effort is passed to the template as `reasoning_effort`. Reasoning comes back as
    reasoning_text items, so the only summary there is to ask for is "auto" (none made)."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto"] | None = None
    generate_summary: Literal["auto"] | None = None  # the older spelling of `summary`


class ResponsesRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """Stateless (store: false): nothing is stored, so `previous_response_id` and
    `conversation` are refused; the whole conversation comes in `input`. A field this server
    does not know (Chat's `n`, say) is a 400 naming it, as OpenAI answers, never ignored."""

    model: str
    # a string (one user message) or a list of items: messages ({role, content}, content a
    # string or input_text parts), function_call and function_call_output items
    input: str | list[dict[str, Any]]
    instructions: str | None = None  # a system message before the input
    max_output_tokens: PositiveInt | None = None  # default: the rest of the context window
    temperature: Annotated[float, Meta(ge=0.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text"|"json_object"|"json_schema"}}
    tools: list[dict[str, Any]] | None = None  # flat: {"type": "function", "name", "parameters"}
    tool_choice: str | dict[str, Any] | None = None  # auto, none, required, {type, name}
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool | None = None  # accepted; nothing is stored whatever it says
    previous_response_id: str | None = None  # refused: needs stored responses
    conversation: str | dict[str, Any] | None = None  # refused: needs stored conversations
    background: bool | None = None  # only false
    top_logprobs: Annotated[int, Meta(ge=0)] | None = None  # only 0
    include: list[str] | None = None  # only []: each extra output named is refused (400)
    metadata: dict[str, str] | None = None  # echoed
    reasoning: Reasoning | None = None
    truncation: Literal["disabled", "auto"] | None = None  # only "disabled": a prompt too long is a 400
    user: str | None = None
    # what admission.serve reads of every request: one choice, no usage chunk
    n: ClassVar[int] = 1
    stream_options: ClassVar[None] = None


# ---- the response --------------------------------------------------------------------------
class OutputText(Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []


class OutputMessage(Struct, kw_only=True, tag_field="type", tag="message"):
    id: str  # msg_...
    status: str  # in_progress, completed, incomplete
    role: str = "assistant"
    content: list[OutputText]


class FunctionCallItem(Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str  # fc_...
    call_id: str  # call_...: what the function_call_output that answers it names
    name: str
    arguments: str  # a JSON object, as a string
    status: str


class ReasoningText(Struct, tag_field="type", tag="reasoning_text"):
    text: str


class ReasoningItem(Struct, kw_only=True, tag_field="type", tag="reasoning"):
    """The model's thinking, apart from its answer (a reasoning parser read it)."""

    id: str  # rs_...
    status: str
    summary: list[Any] = []
    content: list[ReasoningText]


OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


class InputTokensDetails(Struct):
    cached_tokens: int  # prompt tokens served from the prefix cache
    cache_write_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct):
    reason: str  # max_output_tokens


class ResponseError(Struct):
    code: str  # server_error
    message: str


class ResponseObject(Struct, kw_only=True, omit_defaults=True, tag_field="object",
                     tag="response"):
    """Every field is always written (null included) but `error`, there only when failed."""

    id: str  # resp_...
    created_at: int
    status: str  # in_progress, completed, incomplete, failed
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None
    error: ResponseError | None = None
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: Reasoning | None
    store: bool
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: str
    metadata: dict[str, str]
    user: str | None
    background: bool


# ---- stream events -------------------------------------------------------------------------
class Event(Struct, kw_only=True, tag_field="type"):
    """`sequence_number` is set as the event goes on the wire (ResponsesFormat.encode)."""

    sequence_number: int = 0


class ResponseCreated(Event, tag="response.created"):
    response: ResponseObject


class ResponseInProgress(ResponseCreated, tag="response.in_progress"):
    pass


class ResponseCompleted(ResponseCreated, tag="response.completed"):
    pass


class ResponseIncomplete(ResponseCreated, tag="response.incomplete"):
    pass


class ResponseFailed(ResponseCreated, tag="response.failed"):
    pass


class OutputItemAdded(Event, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(OutputItemAdded, tag="response.output_item.done"):
    pass


class ContentPartAdded(Event, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(ContentPartAdded, tag="response.content_part.done"):
    pass


class OutputTextDelta(Event, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []


class OutputTextDone(Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


class ReasoningTextDelta(Event, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(Event, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(Event, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(Event, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str


class ErrorEvent(Event, tag="error"):
    code: str
    message: str
    param: str | None = None
