"""The one way a generation request gets in: every decision made once, in this order.

    0. who?                        the route's guard (gateway/http/auth.py) 401 / 403
    1. ready?                      Runtime.check_ready                      503
    2. which adapter, where?       an alias's target, drawn once (sticky    404 (also for one
                                   per `user`); AdapterManager.locate:      the caller's key
                                   a pinned version (ID@N, ID@sha256:..);   may not use, and
                                   the catalog's entry, read now; here or   a version no longer
                                   only on other replicas                   kept)
    3. another replica?            Router.route: by affinity, or to a       503 if no holder
                                   holder when it cannot be fetched here;   answers
                                   the caller's identity signed for it
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
       the key's limits            Tenants.admit: rpm, tpm (prompt +        429 with
                                   max_tokens), concurrency, fleet-wide     x-ratelimit-*
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
from contextlib import nullcontext
from typing import TYPE_CHECKING

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from loragw.engine.llm_engine import EngineRequest
from loragw.engine.request.checks import check_request
from loragw.engine.request.params import InvalidParam, SamplingParams
from loragw.gateway.errors import APIError
from loragw.gateway.http.auth import RATE_LIMIT_HEADERS, principal
from loragw.gateway.http.format_chat import ChatFormat
from loragw.gateway.http.format_completions import CompletionFormat
from loragw.gateway.http.formats import Format
from loragw.gateway.http.prompts import (
    chat_prompt,
    completion_prompts,
    off_loop_if_large,
    prompt_texts,
)
from loragw.gateway.http.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from loragw.gateway.http.request_params import (
    chat_logprobs,
    check_completion_options,
    check_prompt_logprobs,
    choice_params,
    completion_prompt_logprobs,
    guided_decoding,
    sampling_params,
    tool_names,
)
from loragw.gateway.http.streaming import collect, stream_sse
from loragw.gateway.jobs import Choice, GenerationJob
from loragw.gateway.residency.names import Location
from loragw.gateway.residency.versions import VERSION_HEADER, header_value
from loragw.gateway.runtime import Runtime
from loragw.gateway.tenants.forwarding import sign
from loragw.gateway.tenants.keys import Principal

if TYPE_CHECKING:  # imported only when tracing
    from opentelemetry.trace import Span

CHECK_INLINE_MAX_TOKENS = 16_384  # longer prompts are checked on a worker thread
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
ALIAS_TARGET_HEADER = "x-loragw-alias-target"  # an alias's drawn target, on a forward
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
    """Admission (one trace span with --otlp-traces-endpoint), then the response."""
    with runtime.tracing.span("admission") if runtime.tracing else nullcontext() as span:
        admitted = await admit(request, data, runtime, kind, prepare, span)
    if isinstance(admitted, Response):
        return admitted  # forwarded
    job, fmt = admitted
    served = ({VERSION_HEADER: header_value(job.adapter, job.version)}
              if job.adapter is not None and job.version is not None else {})
    if data.stream:
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        return Stream(stream_sse(job, fmt, include_usage), media_type="text/event-stream",
                      headers=SSE_HEADERS | served, background=BackgroundTask(job.aclose))
    # a whole response: stop generating if the client goes away before it is ready
    return Response(await collect(job, fmt, asyncio.ensure_future(_disconnect(request))),
                    headers=served)


async def admit(request: Request, data: SamplingRequest, runtime: Runtime, kind: str,
                prepare: Prepare, span: Span | None) -> Response | tuple[GenerationJob, Format]:
    """Steps 1-9: the response of the replica it was forwarded to, or the job queued here
    and the Format of its response. `span`: admission's trace span, if tracing."""
    runtime.check_ready()
    state, caller = request.scope["state"], principal(request)
    state["model"] = data.model
    # an alias: one target, drawn once (a forward carries the draw to the replica serving it)
    target = runtime.adapters.aliases.resolve(data.model, data.user, caller.may_use,
                                              chosen=request.headers.get(ALIAS_TARGET_HEADER))
    location = await runtime.adapters.locate(target, caller)
    if span is not None:
        span.set_attributes(runtime.tracing.located(location, runtime.adapters.records))
    forwarded = await runtime.router.route(
        request, location.adapter_id, location.here, location.holders,
        identity(runtime, caller, request),
        {ALIAS_TARGET_HEADER: target} if target != data.model else None)
    if forwarded is not None:
        state["forwarded"] = True  # answered (and counted) by the replica that served it
        return forwarded
    adapter = location.adapter_id
    if adapter is not None:
        await runtime.adapters.ensure_ready(location)
    state["adapter"] = adapter or "base"  # the access log's; set only once resolved
    state["location"] = location  # the metrics labels: adapter and version
    runtime.metrics.resolved(adapter)
    prompts, first, make_format = await prepare()
    job = await start(request, runtime, prompts, first, data.n, location, kind)
    return job, make_format(job)


async def start(request: Request, runtime: Runtime, prompts: list[list[int]],
                first: SamplingParams, n: int, location: Location, kind: str) -> GenerationJob:
    """Steps 7-9: one engine request per choice (prompts x n), checked, admitted and queued at
    once, on the version `location` names."""
    adapter, version = location.adapter_id, location.version
    await check_prompts(runtime, prompts, first)
    params, prompt_of = choice_params(first, len(prompts), n)
    job_id = f"{kind}-{uuid.uuid4().hex}"
    choices = [Choice(i, f"{job_id}-{i}", p, len(prompts[p])) for i, p in enumerate(prompt_of)]
    arrival = request.scope["state"].get("arrival", time.monotonic())
    caller = principal(request)
    job = GenerationJob(job_id, runtime.engine, choices, adapter, runtime.metrics, arrival,
                        runtime.release, tenant=caller.metrics_label, version=version,
                        trace=runtime.tracing.engine_spans(adapter, version)
                        if runtime.tracing else None)
    runtime.admit(job)
    try:
        tokens = reserved_tokens(prompts, params, prompt_of, runtime.info.max_model_len)
        job.reservation, headers = await runtime.tenants.admit(caller, job_id, tokens)
        request.scope["state"][RATE_LIMIT_HEADERS] = headers
        streams = await runtime.engine.submit_many([
            EngineRequest(prompts[c.prompt_index], p, location.engine_adapter, c.request_id)
            for c, p in zip(choices, params, strict=True)])
    except BaseException as exc:
        job.close()
        if isinstance(exc, ValueError):  # the engine refused one: nothing was queued
            raise APIError.from_engine(exc) from None
        raise
    for choice, stream in zip(choices, streams, strict=True):
        choice.stream = stream
    runtime.metrics.count_prompt(adapter, version, sum(len(p) for p in prompts))
    return job


def reserved_tokens(prompts: list[list[int]], params: list[SamplingParams],
                    prompt_of: list[int], max_model_len: int) -> int:
    """What a request takes from its key's tokens per minute at admission: each prompt once
    (as usage counts it) and every choice's max_tokens (or the rest of the context window)."""
    generated = sum(p.max_tokens if p.max_tokens is not None else max_model_len - len(prompts[i])
                    for p, i in zip(params, prompt_of, strict=True))
    return sum(map(len, prompts)) + generated


def identity(runtime: Runtime, caller: Principal, request: Request):
    """The signer of the caller's identity for a forward of this request (None: the fleet's
    secret is not known yet; the target then checks the caller's own key)."""
    secret = runtime.tenants.forward_secret
    if secret is None:
        return None
    return lambda body: sign(secret, caller.key_id, request.scope["method"],
                             request.scope["path"], body)


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
