"""The one way a generation request gets in: every decision made once, in this order.

    1. ready?                      Runtime.check_ready                      503
    2. which adapter, where?       AdapterManager.locate(model): the       404
                                   catalog's entry, read now; here or only
                                   on other replicas
    3. another replica?            Router.route: by affinity, or to a       503 if no holder
                                   holder when it cannot be fetched here    answers
    4. the adapter, here           AdapterManager.ensure_ready              store / Hub / disk
                                                                            -> host
    5. the request's own options   request_params: tools, logprobs, the guided constraint,
                                   SamplingParams (one per request)         400 naming the param
    6. prompts                     prompts: text, token ids, chat template  400
    7. the engine's rules, here    check_request(EngineInfo.limits) on      400 naming the param
                                   every prompt (context window, KV cache,
                                   token ids and their counts, stop strings)
                                   before anything crosses to the engine;
                                   off the loop when the prompts are long
    8. capacity                    Runtime.admit(job)                       400 / 429
    9. queued                      engine.submit_many: the engine runs the same rules again
                                   (it trusts no caller) and queues every choice or none

The endpoints differ only in steps 5-6 and in how the job's increments are shaped (a Format);
`serve` runs the rest for both.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from engine.llm_engine import EngineRequest
from engine.request_checks import check_request
from engine.sampling_params import InvalidParam, SamplingParams
from gateway.errors import APIError
from gateway.http.format_chat import ChatFormat
from gateway.http.format_completions import CompletionFormat
from gateway.http.formats import Format
from gateway.http.prompts import chat_prompt, completion_prompts, off_loop_if_large, prompt_texts
from gateway.http.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from gateway.http.request_params import (
    chat_logprobs,
    check_completion_options,
    check_prompt_logprobs,
    choice_params,
    completion_prompt_logprobs,
    guided_decoding,
    sampling_params,
    tool_names,
)
from gateway.http.streaming import collect, stream_sse
from gateway.jobs import Choice, GenerationJob
from gateway.runtime import Runtime

CHECK_INLINE_MAX_TOKENS = 16_384  # longer prompts are checked on a worker thread
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Steps 5-6 of one endpoint: the body -> (prompts, first choice's params, the Format of the
# job's response; its response id is the job's).
Prepare = Callable[[], Awaitable[tuple[list[list[int]], SamplingParams,
                                        Callable[[GenerationJob], Format]]]]


async def serve_completion(request: Request, data: CompletionRequest, runtime: Runtime):
    async def prepare():
        check_completion_options(data)
        check_prompt_logprobs(data)
        first = sampling_params(data, data.logprobs, guided_decoding(data, None),
                                completion_prompt_logprobs(data))
        prompts = await off_loop_if_large(completion_prompts, data, runtime.tokenizer)
        # what echo shows, once the engine has accepted the prompts' token ids
        echo = (lambda: prompt_texts(data, prompts, runtime.tokenizer)) if data.echo else None
        return prompts, first, lambda job: CompletionFormat(
            job.id, data.model, runtime.token_text, data.logprobs is not None,
            data.prompt_logprobs is not None, echo=echo() if echo else None, prompts=prompts,
            only_prompt=data.max_tokens == 0)

    return await serve(request, data, runtime, "cmpl", prepare)


async def serve_chat(request: Request, data: ChatCompletionRequest, runtime: Runtime):
    async def prepare():
        names = tool_names(data)  # None: no tools in play
        check_prompt_logprobs(data)
        first = sampling_params(data, chat_logprobs(data), guided_decoding(data, names),
                                data.prompt_logprobs)
        prompt = await off_loop_if_large(chat_prompt, data, runtime.tokenizer)
        return [prompt], first, lambda job: ChatFormat(
            job.id, data.model, runtime.token_text, data.logprobs,
            data.prompt_logprobs is not None, tool_names=names)

    return await serve(request, data, runtime, "chatcmpl", prepare)


async def serve(request: Request, data: SamplingRequest, runtime: Runtime, kind: str,
                prepare: Prepare) -> Response:
    runtime.check_ready()
    state = request.scope["state"]
    state["model"] = data.model
    location = await runtime.adapters.locate(data.model)
    forwarded = await runtime.router.route(request, location.adapter_id, location.here,
                                           location.holders)
    if forwarded is not None:
        return forwarded
    adapter = location.adapter_id
    if adapter is not None:
        await runtime.adapters.ensure_ready(location)
    state["adapter"] = adapter or "base"  # the metrics label; set only once resolved
    prompts, first, make_format = await prepare()
    job = await start(request, runtime, prompts, first, data.n, adapter, kind)
    fmt = make_format(job)
    if data.stream:
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        return Stream(stream_sse(job, fmt, include_usage), media_type="text/event-stream",
                      headers=SSE_HEADERS, background=BackgroundTask(job.aclose))
    # a whole response: stop generating if the client goes away before it is ready
    return Response(await collect(job, fmt, asyncio.ensure_future(_disconnect(request))))


async def start(request: Request, runtime: Runtime, prompts: list[list[int]],
                first: SamplingParams, n: int, adapter: str | None, kind: str) -> GenerationJob:
    """Steps 7-9: one engine request per choice (prompts x n), checked, admitted and queued at
    once."""
    await check_prompts(runtime, prompts, first)
    params, prompt_of = choice_params(first, len(prompts), n)
    job_id = f"{kind}-{uuid.uuid4().hex}"
    choices = [Choice(i, f"{job_id}-{i}", p, len(prompts[p])) for i, p in enumerate(prompt_of)]
    arrival = request.scope["state"].get("arrival", time.monotonic())
    job = GenerationJob(job_id, runtime.engine, choices, adapter, runtime.metrics, arrival,
                        runtime.release)
    runtime.admit(job)
    try:
        streams = await runtime.engine.submit_many([
            EngineRequest(prompts[c.prompt_index], p, adapter, c.request_id)
            for c, p in zip(choices, params, strict=True)])
    except BaseException as exc:
        job.close()
        if isinstance(exc, ValueError):  # the engine refused one: nothing was queued
            raise APIError.from_engine(exc) from None
        raise
    for choice, stream in zip(choices, streams, strict=True):
        choice.stream = stream
    runtime.metrics.prompt_tokens.labels(adapter or "base").inc(sum(len(p) for p in prompts))
    return job


async def check_prompts(runtime: Runtime, prompts: list[list[int]],
                        first: SamplingParams) -> None:
    """Step 7. The n choices of a prompt differ only in their seeds, which no rule reads."""
    def check() -> None:
        for prompt in prompts:
            check_request(runtime.info.limits, prompt, first)

    try:
        if sum(map(len, prompts)) <= CHECK_INLINE_MAX_TOKENS:
            check()
        else:
            await asyncio.to_thread(check)
    except InvalidParam as exc:
        raise APIError.from_engine(exc) from None


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
