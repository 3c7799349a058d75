"""POST /v1/responses: OpenAI's Responses API, stateless, served as the chat request it means.

The request becomes a ChatCompletionRequest (`chat_request`: instructions as the system
message, input items as messages, flat function tools in chat's shape, text.format as
response_format), which then goes the chat route's way through admission (`serve`): routing,
the adapter, tool_names / guided_decoding / sampling_params, the chat template, capacity, the
engine's check. Only the shape of the answer differs (ResponsesFormat), so an adapter's output
here equals the chat route's for the same messages.
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from typing import Any

import msgspec
from litestar import Controller, Request, Response, post
from litestar.openapi import ResponseSpec

from loragw.gateway.common.errors import APIError
from loragw.gateway.http.auth import require_api_key
from loragw.gateway.http.error_handlers import error_responses
from loragw.gateway.http.openapi_docs import streamed
from loragw.gateway.openai.admission import AdmissionDep, serve
from loragw.gateway.openai.chat_setup import chat_reading
from loragw.gateway.openai.params import guided_decoding, sampling_params, tool_names
from loragw.gateway.openai.prompts import chat_prompt, off_loop_if_large
from loragw.gateway.openai.protocol import ChatCompletionRequest, ChatMessage, ResponseFormat
from loragw.gateway.responses import protocol as rp
from loragw.gateway.responses.format import ResponsesFormat
from loragw.gateway.responses.protocol import Reasoning, ResponseObject, ResponsesRequest

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")  # output_text: an earlier answer sent back
# The chat request's parameter names -> the Responses request's, for the 400s that name one.
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
          "response_format": "text.format"}
FLAT_TOOL = '{"type": "function", "name": ..., "parameters": {...}}'


def chat_request(data: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request means; a 400 names what cannot be served."""
    for name in ("previous_response_id", "conversation"):
        if getattr(data, name) is not None:
            raise APIError.bad_request(
                f"{name} needs stored responses, and this server stores none (store: false); "
                "send the whole conversation in `input` instead", param=name,
                code="unsupported_parameter")
    if data.background:
        raise APIError.not_supported("background responses", "background")
    if data.top_logprobs:
        raise APIError.not_supported("logprobs on /v1/responses", "top_logprobs")
    if data.include:
        raise APIError.not_supported(f"include {data.include[:8]!r}", "include")
    if data.truncation == "auto":
        raise APIError.not_supported('truncation "auto" (dropping input to fit the context '
                                     'window)', "truncation")
    system = [ChatMessage(role="system", content=data.instructions)] if data.instructions else []
    return ChatCompletionRequest(
        model=data.model, messages=system + input_messages(data.input),
        max_tokens=data.max_output_tokens, temperature=data.temperature, top_p=data.top_p,
        stream=data.stream, user=data.user, response_format=response_format(data.text),
        tools=[chat_tool(t, i) for i, t in enumerate(data.tools or [])] or None,
        tool_choice=chat_tool_choice(data.tool_choice),
        parallel_tool_calls=data.parallel_tool_calls,
        chat_template_kwargs=template_kwargs(data.reasoning))


def template_kwargs(reasoning: Reasoning | None) -> dict[str, Any] | None:
    """What `reasoning.effort` asks of the chat template: none, no thinking."""
    if reasoning is None or reasoning.effort is None:
        return None
    if reasoning.effort == "none":
        return {"enable_thinking": False}
    return {"reasoning_effort": reasoning.effort}


def input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """`input` -> chat messages: message items as they are, function_call items as the
    assistant's tool_calls, function_call_output items as tool messages."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    if not items:
        raise APIError.bad_request("input must be a string or a non-empty list of items",
                                   param="input")
    messages: list[ChatMessage] = []
    for i, item in enumerate(items):
        kind, where = item.get("type", "message"), f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise APIError.bad_request(f"{where}.role must be one of {', '.join(ROLES)}, "
                                           f"got {role!r}", param=f"{where}.role")
            messages.append(ChatMessage(role=role, content=_text(item.get("content"),
                                                                  f"{where}.content")))
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not all(isinstance(v, str) for v in (call["id"], *call["function"].values())):
                raise APIError.bad_request(f"{where} (a function_call) needs call_id, name and "
                                           "arguments, each a string", param=where)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]  # calls of one turn
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            messages.append(ChatMessage(role="tool", tool_call_id=item.get("call_id"),
                                        content=_text(item.get("output"), f"{where}.output")))
        else:
            raise APIError.bad_request(
                f"{where} is a {kind!r} item; this server takes message, function_call and "
                "function_call_output items, with text content only", param=f"{where}.type",
                code="unsupported_parameter")
    return messages


def _text(content: object, where: str) -> str:
    """A string, or text parts joined as chat joins them; any other part is a 400 naming it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError.bad_request(f"{where} must be a string or a list of input_text parts",
                                   param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError.bad_request(
                f"{where}[{j}] is a {kind!r} part; this server takes text only: send "
                "input_text parts (no input_image, input_file or input_audio)",
                param=f"{where}[{j}].type", code="unsupported_parameter")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A flat Responses function tool -> chat's {"type": "function", "function": {...}}."""
    if tool.get("type") != "function":
        raise APIError.bad_request(f"tools[{i}] is a {tool.get('type')!r} tool; this server runs "
                                   f"function tools only: {FLAT_TOOL}", param=f"tools[{i}].type",
                                   code="unsupported_parameter")
    parameters = tool.get("parameters")
    if not isinstance(tool.get("name"), str) or not (parameters is None
                                                     or isinstance(parameters, dict)):
        raise APIError.bad_request(f"tools[{i}] must be {FLAT_TOOL} (flat: Responses tools have "
                                   "no `function` object)", param=f"tools[{i}]")
    return {"type": "function", "function": {
        key: tool[key] for key in ("name", "description", "parameters") if key in tool}}


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError.bad_request('tool_choice must be auto, none, required or {"type": '
                               '"function", "name": ...}', param="tool_choice")


def response_format(text: dict[str, Any] | None) -> ResponseFormat | None:
    """text.format -> chat's response_format (the same structured-output path)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return ResponseFormat(kind)
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError.bad_request("text.format json_schema needs `schema`, a JSON schema "
                                       "object", param="text.format.schema")
        return ResponseFormat("json_schema", {"name": fmt.get("name"), "schema": fmt["schema"],
                                              "strict": fmt.get("strict")})
    raise APIError.bad_request(f"text.format.type must be text, json_object or json_schema, "
                               f"got {kind!r}", param="text.format.type")


def response_template(data: ResponsesRequest) -> ResponseObject:
    """The response as it starts: no output yet, the request's settings echoed."""
    return ResponseObject(
        id="", created_at=int(time.time()), status="in_progress", model=data.model, output=[],
        usage=None, incomplete_details=None, instructions=data.instructions,
        max_output_tokens=data.max_output_tokens,
        parallel_tool_calls=data.parallel_tool_calls is not False, previous_response_id=None,
        reasoning=data.reasoning, store=False,
        temperature=1.0 if data.temperature is None else data.temperature,
        top_p=1.0 if data.top_p is None else data.top_p,
        text=data.text or {"format": {"type": "text"}}, tool_choice=data.tool_choice or "auto",
        tools=data.tools or [], truncation=data.truncation or "disabled",
        metadata=data.metadata or {}, user=data.user, background=False)


async def serve_responses(request: Request, data: ResponsesRequest,
                          admission: AdmissionDep) -> Response:
    async def prepare(location):
        setup = admission.chat_setup(location)
        chat = chat_request(data)
        names = tool_names(chat)  # None: no tools in play
        reading, keep_specials, forced = chat_reading(chat, setup, names)
        first = sampling_params(chat, None, guided_decoding(chat, names, forced), None,
                                setup.generation)
        if keep_specials:  # the parsers' markers are special tokens: decode them
            first = replace(first, skip_special_tokens=False)
        prompt = await off_loop_if_large(
            partial(chat_prompt, setup=setup, bound=admission.bound(first)), chat,
            admission.served.tokenizer)
        template = response_template(data)
        return [prompt], first, lambda job: ResponsesFormat(
            msgspec.structs.replace(template, id=job.id.replace("resp-", "resp_", 1)),
            admission.served.token_text, reading)

    try:
        return await serve(request, data, admission, "resp", prepare)
    except APIError as exc:  # name the parameter as this request spells it
        exc.param = PARAMS.get(exc.param, exc.param)
        raise


STREAM_EVENTS = (rp.ResponseCreated, rp.ResponseInProgress, rp.ResponseCompleted, rp.ResponseIncomplete, rp.ResponseFailed, rp.OutputItemAdded, rp.OutputItemDone, rp.ContentPartAdded, rp.ContentPartDone, rp.OutputTextDelta, rp.OutputTextDone, rp.ReasoningTextDelta, rp.ReasoningTextDone, rp.FunctionCallArgumentsDelta, rp.FunctionCallArgumentsDone, rp.ErrorEvent)


class ResponsesController(Controller):
    path = "/v1"
    guards = [require_api_key]
    tags = ["OpenAI"]

    @post("/responses", status_code=200, operation_class=streamed(*STREAM_EVENTS, done=False),
          responses={
        200: ResponseSpec(ResponseObject, generate_examples=False, description=(
            "ResponseObject; with stream=true, text/event-stream of typed events "
            "(`event: <type>` + `data: {...}`), the last response.completed, "
            "response.incomplete or response.failed")),
        **error_responses(400, 401, 404, 413, 422, 429, 502, 503, e400=(
            "invalid body or parameter (`param` names it), an input item or tool this server "
            "does not run (images, files, hosted tools), or stored state asked for "
            "(previous_response_id)"))})
    async def create_response(self, request: Request, data: ResponsesRequest,
                              admission: AdmissionDep) -> Response:
        return await serve_responses(request, data, admission)
