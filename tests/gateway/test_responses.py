"""POST /v1/responses through the live gateway and the official openai client: the same text as
the chat route for the same messages (base and adapters), structured output and function
calls, OpenAI's typed stream events, and the 400s / 404s of what it cannot serve."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from loragw.engine.request.sequence import RequestOutput
from loragw.gateway.http.jobs import Choice, TokenCounts
from loragw.gateway.openai.streaming import stream_sse
from loragw.gateway.responses.format import ResponsesFormat
from loragw.gateway.responses.protocol import ResponsesRequest
from loragw.gateway.responses.routes import response_template

BASE = "demo-base"  # conftest's served model name
ADAPTER = "lora-2"
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "temp": {"type": "integer", "minimum": -30, "maximum": 50},
    "tags": {"type": "array", "items": {"enum": ["sun", "rain"]}, "minItems": 1, "maxItems": 3}},
    "required": ["city", "temp", "tags"]}
TEXT_FORMAT = {"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA,
                          "strict": True}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "weather now",
          "parameters": SCHEMA},
         {"type": "function", "name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"]}}]
GREEDY = {"temperature": 0, "max_output_tokens": 12}
EVENTS = TypeAdapter(ResponseStreamEvent)
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added"]
TEXT_DONE = ["response.output_text.done", "response.content_part.done",
             "response.output_item.done"]


def chat(client, model: str, messages: list[dict]):
    """The chat route's answer to the same messages, as GREEDY asks."""
    return client.chat.completions.create(model=model, messages=messages, temperature=0,
                                          max_tokens=GREEDY["max_output_tokens"])


@pytest.mark.parametrize("model", [BASE, ADAPTER])
def test_string_input_answers_what_chat_answers(client, model):
    r = client.responses.create(model=model, input="Tell me a story", **GREEDY)
    same = chat(client, model, [{"role": "user", "content": "Tell me a story"}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model
    assert r.output_text == same.choices[0].message.content
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    assert message.content[0].annotations == []
    finish = same.choices[0].finish_reason
    assert r.status == ("incomplete" if finish == "length" else "completed")
    assert r.usage.input_tokens == same.usage.prompt_tokens
    assert r.usage.output_tokens == same.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.tools == [] and r.tool_choice == "auto" and r.parallel_tool_calls is True
    assert r.temperature == 0 and r.max_output_tokens == 12


def test_messages_with_instructions_are_the_chat_messages_after_a_system_one(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                          {"type": "input_text", "text": "there"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Ahoy", "annotations": []}]},
             {"role": "user", "content": "Tell me a story"}]
    r = client.responses.create(model=ADAPTER, instructions="Be brief.", input=items, **GREEDY)
    same = chat(client, ADAPTER, [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Hi\nthere"},
                                  {"role": "assistant", "content": "Ahoy"},
                                  {"role": "user", "content": "Tell me a story"}])
    assert r.output_text == same.choices[0].message.content and r.instructions == "Be brief."
    assert r.usage.input_tokens == same.usage.prompt_tokens


def test_max_output_tokens_makes_an_incomplete_response(client):
    r = client.responses.create(model=BASE, input="Tell me a story", temperature=0,
                                max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


@pytest.mark.parametrize("model", [BASE, ADAPTER])
def test_json_schema_text_format_validates(client, model):
    r = client.responses.create(model=model, input="What is the weather?", text=TEXT_FORMAT,
                                temperature=1.0, max_output_tokens=150)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema" and r.text.format.name == "weather"


@pytest.mark.parametrize("tool_choice, allowed", [
    ("required", ["get_weather", "add"]), ({"type": "function", "name": "add"}, ["add"])])
def test_a_forced_function_call_is_a_function_call_item(client, tool_choice, allowed):
    r = client.responses.create(model=ADAPTER, input="Add 2 and 3", tools=TOOLS,
                                tool_choice=tool_choice, temperature=1.0, max_output_tokens=150)
    assert r.status == "completed"
    (call,) = r.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name in allowed
    params = {t["name"]: t["parameters"] for t in TOOLS}[call.name]
    jsonschema.validate(json.loads(call.arguments), params)
    assert [t.name for t in r.tools] == ["get_weather", "add"]
    # the call and its output go back in as the next turn's input (stateless)
    follow = client.responses.create(model=ADAPTER, tools=TOOLS, **GREEDY, input=[
        {"role": "user", "content": "Add 2 and 3"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert follow.status in ("completed", "incomplete")


def test_a_stream_is_typed_events_ending_with_the_whole_response(client):
    body = {"model": ADAPTER, "input": "What is the weather?", "text": TEXT_FORMAT,
            "temperature": 0, "max_output_tokens": 150}
    with client.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", *TEXT_EVENTS,
                     *["response.output_text.delta"] * len(deltas), *TEXT_DONE,
                     "response.completed"]
    assert len(deltas) > 1, "the text streams as it is generated"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert "".join(deltas) == final.output_text == events[-4].text
    whole = client.responses.create(**body)
    assert final.id == events[0].response.id != whole.id
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    jsonschema.validate(json.loads(final.output_text), SCHEMA)


def test_an_incomplete_stream_ends_with_response_incomplete(client):
    events = list(client.responses.create(model=BASE, input="Tell me a story", stream=True,
                                          **GREEDY))
    assert events[-1].type == "response.incomplete"
    last = events[-1].response
    whole = client.responses.create(model=BASE, input="Tell me a story", **GREEDY)
    assert last.output_text == whole.output_text and last.status == whole.status == "incomplete"
    assert last.usage.output_tokens == whole.usage.output_tokens == 12


def test_a_streamed_function_call(client):
    events = list(client.responses.create(
        model=ADAPTER, input="Add 2 and 3", tools=TOOLS, stream=True, temperature=1.0,
        tool_choice={"type": "function", "name": "add"}, max_output_tokens=150))
    kinds = [e.type for e in events]
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(fragments),
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.name == "add" and added.arguments == ""
    assert added.status == "in_progress" and done.status == "completed"
    assert "".join(fragments) == done.arguments == events[-3].arguments
    jsonschema.validate(json.loads(done.arguments), TOOLS[1]["parameters"])
    assert events[-1].response.output[0].call_id == added.call_id


@pytest.mark.parametrize("extra", [{}, {"tools": TOOLS, "tool_choice": "required",
                                       "max_output_tokens": 150, "temperature": 1.0}])
def test_the_wire_validates_against_the_sdks_own_models(http, extra):
    """Each event and the whole response, checked field by field by the openai package's
    pydantic models (the client itself builds them without validating)."""
    body = {"model": BASE, "input": "hi", **GREEDY, **extra}
    Response.model_validate(http.post("/v1/responses", json=body).json())
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    frames = [f for f in text.split("\n\n") if f]
    assert "[DONE]" not in text and frames[0].startswith("event: response.created\n")
    for frame in frames:
        event, data = frame.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        parsed = EVENTS.validate_json(data[len("data: "):])
        assert parsed.type == event[len("event: "):]


@pytest.mark.parametrize("body, status, says", [
    ({"previous_response_id": "resp_123"}, 400, "previous_response_id"),
    ({"conversation": "conv_1"}, 400, "conversation"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]}, 400, "input_image"),
    ({"input": [{"type": "input_file", "file_id": "f"}]}, 400, "input_file"),
    ({"tools": [{"type": "web_search"}]}, 400, "web_search"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "flat"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "schema"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, 400, "nope"),
    ({"model": "no-such-model"}, 404, "no-such-model"),
    ({"n": 2}, 400, "`n`"),  # Chat's, not the Responses API's: named, never ignored
    ({"include": ["reasoning.encrypted_content"]}, 400, "include"),
    ({"truncation": "auto"}, 400, "truncation"),
    ({"reasoning": {"summary": "detailed"}}, 400, "summary"),
    ({"reasoning": {"effort": "max"}}, 400, "effort"),
])
def test_what_cannot_be_served_is_an_openai_error(http, body, status, says):
    r = http.post("/v1/responses", json={"model": BASE, "input": "hi", **GREEDY, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error"


def test_the_client_raises_for_previous_response_id_and_unknown_models(client):
    with pytest.raises(openai.BadRequestError, match="previous_response_id") as info:
        client.responses.create(model=BASE, input="hi", previous_response_id="resp_1")
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="hi")


# ---- the stream's failure, without a server --------------------------------------------------
class FailingJob:
    """A job whose engine sends one increment, then fails."""

    def __init__(self):
        self.choices = [Choice(0, "r-0", 0, 5)]
        self.num_unfinished, self.counts = 1, TokenCounts(5, 1, 0)
        self.closed = False

    def start(self, sink):
        sink(self.choices[0], RequestOutput(
            request_id="r-0", new_token_ids=[7], new_text="Ahoy", new_logprobs=[],
            finished=False, finish_reason=None, stop_reason=None, num_prompt_tokens=5,
            num_output_tokens=1))
        sink(self.choices[0], RuntimeError("the engine died"))

    def close(self):
        self.closed = True


def test_an_engine_failure_mid_stream_is_an_error_event_then_response_failed():
    template = response_template(ResponsesRequest(model=BASE, input="hi"))
    fmt = ResponsesFormat(template, None, None)
    job = FailingJob()

    async def read() -> bytes:
        return b"".join([chunk async for chunk in stream_sse(job, fmt, False)])

    frames = asyncio.run(read()).decode().strip().split("\n\n")
    kinds = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert kinds == ["response.created", "response.in_progress", *TEXT_EVENTS,
                     "response.output_text.delta", "error", "response.failed"]
    for frame in frames:
        EVENTS.validate_json(frame.split("\n")[1].removeprefix("data: "))
    error = json.loads(frames[-2].split("\n")[1].removeprefix("data: "))
    assert "the engine died" in error["message"] and error["code"] == "server_error"
    failed = json.loads(frames[-1].split("\n")[1].removeprefix("data: "))["response"]
    assert failed["status"] == "failed" and "the engine died" in failed["error"]["message"]
    assert failed["output"][0]["content"][0]["text"] == "Ahoy" and job.closed


def test_an_aborted_generation_is_a_failed_response():
    """finish_reason "abort" (the server stopping, the adapter unloaded): status failed."""
    fmt = ResponsesFormat(response_template(ResponsesRequest(model=BASE, input="hi")), None,
                          None)
    choice = Choice(0, "r-0", 0, 5, finished=True, finish_reason="abort", num_output_tokens=1)
    out = RequestOutput(request_id="r-0", new_token_ids=[7], new_text="Ahoy", new_logprobs=[],
                        finished=True, finish_reason="abort", stop_reason=None,
                        num_prompt_tokens=5, num_output_tokens=1)
    r = fmt.whole([choice], {0: [out]}, TokenCounts(5, 1, 0))
    assert r.status == "failed" and "retry" in r.error.message
    assert r.output[0].status == "incomplete" and r.output[0].content[0].text == "Ahoy"
    assert r.usage.total_tokens == 6
