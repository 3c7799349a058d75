"""The one way a generation request gets in: every decision made once, in this order.

    0. who?                        the route's guard (gateway/http/auth.py) 401 / 403
    1. ready?                      the `admission` dependency (Services)    503
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
    8. capacity                    Capacity.admit(job)                      400 / 429
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
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Annotated

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.params import Dependency
from litestar.response import Stream

from loragw.engine.api import (
    EngineClient,
    EngineRequest,
    InvalidParam,
    RequestLimits,
    SamplingParams,
    check_request,
    with_max_tokens,
)
from loragw.gateway.common.errors import APIError
from loragw.gateway.common.records import Location
from loragw.gateway.fleet.router import Router
from loragw.gateway.http.auth import RATE_LIMIT_HEADERS, principal
from loragw.gateway.http.capacity import Capacity
from loragw.gateway.http.jobs import Choice, GenerationJob
from loragw.gateway.http.served import ServedModel
from loragw.gateway.observe.metrics import Metrics
from loragw.gateway.openai.adapter_chats import AdapterChats
from loragw.gateway.openai.chat_setup import ChatSetup, chat_reading
from loragw.gateway.openai.format_chat import ChatFormat
from loragw.gateway.openai.format_completions import CompletionFormat
from loragw.gateway.openai.formats import Format
from loragw.gateway.openai.params import (
    chat_logprobs,
    check_completion_options,
    check_prompt_logprobs,
    choice_params,
    completion_prompt_logprobs,
    guided_decoding,
    sampling_params,
    tool_names,
)
from loragw.gateway.openai.prompt_bounds import ContextBound
from loragw.gateway.openai.prompts import (
    chat_prompt,
    completion_prompts,
    off_loop_if_large,
    prompt_texts,
)
from loragw.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from loragw.gateway.openai.streaming import collect, stream_sse
from loragw.gateway.residency import aliases
from loragw.gateway.residency.info import chat_of
from loragw.gateway.residency.manager import AdapterManager
from loragw.gateway.residency.versions import VERSION_HEADER, header_value
from loragw.gateway.tenants.forwarding import sign
from loragw.gateway.tenants.keys import Principal
from loragw.gateway.tenants.service import Tenants

if TYPE_CHECKING:  # imported only when tracing
    from opentelemetry.trace import Span

    from loragw.gateway.observe.tracing import Tracing

CHECK_INLINE_MAX_TOKENS = 16_384  # longer prompts are checked on a worker thread
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
ALIAS_TARGET_HEADER = "x-loragw-alias-target"  # an alias's drawn target, on a forward
# Steps 5-6 of one endpoint: the body, for the model at `location` -> (prompts, first
# choice's params, the Format of the job's response; its response id is the job's).
Prepare = Callable[[Location], Awaitable[tuple[list[list[int]], SamplingParams,
                                                Callable[[GenerationJob], Format]]]]


@dataclass(frozen=True, slots=True)
class Admission:
    """What admitting a generation request takes (Services builds it once the engine is up)."""

    engine: EngineClient
    adapters: AdapterManager
    router: Router
    tenants: Tenants
    capacity: Capacity
    metrics: Metrics
    tracing: Tracing | None
    served: ServedModel
    chats: AdapterChats  # the base model's chat setup, and each adapter's over it

    def chat_setup(self, location: Location) -> ChatSetup:
        """How the model (and version) `location` names speaks chat."""
        return self.chats.setup(chat_of(self.adapters.records, location))

    def bound(self, first: SamplingParams) -> ContextBound:
        """The room a prompt has beside the max_tokens `first` asks for."""
        return ContextBound(self.served.info.limits.max_model_len, first.max_tokens)


# As a route's dependency: built once by Services, never re-validated per request.
AdmissionDep = Annotated[Admission, Dependency(skip_validation=True)]


async def serve_completion(request: Request, data: CompletionRequest, admission: Admission):
    async def prepare(location: Location):
        check_completion_options(data)
        check_prompt_logprobs(data)
        first = sampling_params(data, data.logprobs, guided_decoding(data, None),
                                completion_prompt_logprobs(data))
        prompts = await off_loop_if_large(partial(completion_prompts, bound=admission.bound(first)),
                                          data, admission.served.tokenizer)
        # what echo shows, once the engine has accepted the prompts' token ids
        echo = (lambda: prompt_texts(data, prompts, admission.served.tokenizer)) if data.echo else None
        return prompts, first, lambda job: CompletionFormat(
            job.id, data.model, admission.served.token_text, data.logprobs is not None,
            data.prompt_logprobs is not None, echo=echo() if echo else None, prompts=prompts,
            only_prompt=data.max_tokens == 0)

    return await serve(request, data, admission, "cmpl", prepare)


async def serve_chat(request: Request, data: ChatCompletionRequest, admission: Admission):
    async def prepare(location: Location):
        setup = admission.chat_setup(location)
        names = tool_names(data)  # None: no tools in play
        check_prompt_logprobs(data)
        reading, keep_specials, forced = chat_reading(data, setup, names)
        first = sampling_params(data, chat_logprobs(data), guided_decoding(data, names, forced),
                                data.prompt_logprobs, setup.generation)
        if keep_specials:  # the parsers' markers are special tokens: decode them
            first = replace(first, skip_special_tokens=False)
        prompt = await off_loop_if_large(
            partial(chat_prompt, setup=setup, bound=admission.bound(first)), data,
            admission.served.tokenizer)
        if first.guided is not None:  # a grammar constrains the answer, not the thinking
            first = replace(first, guided=replace(first.guided, after=setup.answer_after(prompt)))
        return [prompt], first, lambda job: ChatFormat(
            job.id, data.model, admission.served.token_text, data.logprobs,
            data.prompt_logprobs is not None, reading=reading)

    return await serve(request, data, admission, "chatcmpl", prepare)


async def serve(request: Request, data: SamplingRequest, admission: Admission, kind: str,
                prepare: Prepare) -> Response:
    """Admission (one trace span with --otlp-traces-endpoint), then the response."""
    tracing = admission.tracing
    with tracing.span("admission") if tracing else nullcontext() as span:
        admitted = await admit(request, data, admission, kind, prepare, span)
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


async def admit(request: Request, data: SamplingRequest, admission: Admission, kind: str,
                prepare: Prepare, span: Span | None) -> Response | tuple[GenerationJob, Format]:
    """Steps 1-9: the response of the replica it was forwarded to, or the job queued here
    and the Format of its response. `span`: admission's trace span, if tracing."""
    adapters = admission.adapters
    state, caller = request.scope["state"], principal(request)
    state["model"] = data.model
    # an alias: one target, drawn once (a forward carries the draw to the replica serving it)
    target, location = await aliases.locate_model(adapters, caller, data.model, data.user,
                                                  request.headers.get(ALIAS_TARGET_HEADER))
    if span is not None:
        span.set_attributes(admission.tracing.located(location, adapters.records))
    forwarded = await admission.router.route(
        request, location.adapter_id, location.here, location.holders,
        identity(admission.tenants, caller, request),
        {ALIAS_TARGET_HEADER: target} if target != data.model else None, data.user)
    if forwarded is not None:
        state["forwarded"] = True  # answered (and counted) by the replica that served it
        return forwarded
    adapter = location.adapter_id
    if adapter is not None:
        await adapters.ensure_ready(location)
    state["adapter"] = adapter or "base"  # the access log's; set only once resolved
    state["location"] = location  # the metrics labels: adapter and version
    admission.metrics.resolved(adapter)
    prompts, first, make_format = await prepare(location)
    job = await start(request, admission, prompts, first, data.n, location, kind)
    return job, make_format(job)


async def start(request: Request, admission: Admission, prompts: list[list[int]],
                first: SamplingParams, n: int, location: Location, kind: str) -> GenerationJob:
    """Steps 7-9: one engine request per choice (prompts x n), checked, admitted and queued at
    once, on the version `location` names."""
    adapter, version = location.adapter_id, location.version
    limits = admission.served.info.limits
    await check_prompts(limits, prompts, first)
    params, prompt_of = choice_params(first, len(prompts), n)
    params = [with_max_tokens(p, len(prompts[i]), limits.max_model_len)  # decided once, here
              for p, i in zip(params, prompt_of, strict=True)]
    job_id = f"{kind}-{uuid.uuid4().hex}"
    choices = [Choice(i, f"{job_id}-{i}", p, len(prompts[p])) for i, p in enumerate(prompt_of)]
    arrival = request.scope["state"].get("arrival", time.monotonic())
    caller = principal(request)
    tracing, capacity = admission.tracing, admission.capacity
    job = GenerationJob(job_id, admission.engine, choices, adapter, admission.metrics, arrival,
                        capacity.release, tenant=caller.metrics_label, version=version,
                        trace=tracing.engine_spans(adapter, version) if tracing else None)
    capacity.admit(job)
    try:
        tokens = sum(map(len, prompts)) + sum(p.max_tokens for p in params)
        job.reservation, headers = await admission.tenants.admit(caller, job_id, tokens)
        request.scope["state"][RATE_LIMIT_HEADERS] = headers
        streams = await admission.engine.submit_many([
            EngineRequest(prompts[c.prompt_index], p, location.engine_adapter, c.request_id)
            for c, p in zip(choices, params, strict=True)])
    except BaseException as exc:
        job.close()
        if isinstance(exc, ValueError):  # the engine refused one: nothing was queued
            raise APIError.from_engine(exc) from None
        raise
    for choice, stream in zip(choices, streams, strict=True):
        choice.stream = stream
    admission.metrics.count_prompt(adapter, version, sum(len(p) for p in prompts))
    return job


def identity(tenants: Tenants, caller: Principal, request: Request):
    """The signer of the caller's identity for a forward of this request (None: the fleet's
    secret is not known yet; the target then checks the caller's own key)."""
    secret = tenants.forward_secret
    if secret is None:
        return None
    return lambda body: sign(secret, caller.key_id, request.scope["method"],
                             request.scope["path"], body)


async def check_prompts(limits: RequestLimits, prompts: list[list[int]],
                        first: SamplingParams) -> None:
    """Step 7. The n choices of a prompt differ only in their seeds, which no rule reads."""
    def check() -> None:
        for prompt in prompts:
            check_request(limits, prompt, first)

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
