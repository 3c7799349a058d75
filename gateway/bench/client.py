"""`loragw bench`: a serving benchmark in the manner of vLLM's `vllm bench serve`.

Requests arrive as a Poisson process (`--request-rate`; inf sends them all at once) with at
most `--concurrency` in flight, each naming one model id: the base model or an adapter, spread
round-robin or by a zipf law. Streams ask for `stream_options.include_usage`, so output tokens
are the server's own count. TTFT is the time to the first chunk that carries text; TPOT is
(e2e - TTFT) / (output tokens - 1), so a one-token request has none (as in vLLM).

Without --url, `loragw serve` is started in a subprocess (so client and server do not share a
GIL) and stopped at the end; its other settings come from LORAGW_* variables, which it inherits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

import httpx
from tqdm import tqdm

from loragw.gateway.bench.config import ENDPOINTS, BenchConfig
from loragw.gateway.bench.report import BenchResult, RequestResult, format_table, summarize
from loragw.gateway.bench.server import ServerStartError, serve_subprocess

logger = logging.getLogger(__name__)

PROMPTS = ("Tell me about the ocean.", "Write a short poem about the moon.",
           "How do I bake bread?", "What is a robot?", "Describe your favourite meal.",
           "Why is the sky blue?", "Give me three tips for learning to sail.",
           "Summarise the plot of a heist film in two sentences.")
REQUEST_TIMEOUT_S = 600.0  # a request may wait in the server's queue behind many others


class BenchError(Exception):
    """A setup failure the user fixes (no server there, an unknown model id): its message is
    the whole report."""


def assign_models(ids: list[str], n: int, distribution: str, rng: random.Random) -> list[str]:
    """The model id of each of n requests: round-robin (exactly even shares) for uniform;
    for zipf the k-th id (from 1) is drawn with weight 1/k, as a few hot adapters and a long
    tail of cold ones."""
    if distribution == "uniform":
        return [ids[i % len(ids)] for i in range(n)]
    return rng.choices(ids, weights=[1 / k for k in range(1, len(ids) + 1)], k=n)


def request_body(config: BenchConfig, model: str, prompt: str, max_tokens: int,
                 stream: bool) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream,
            "ignore_eos": config.ignore_eos}
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def http_error(response: httpx.Response) -> str:
    """`HTTP 404: <message>`, the message from OpenAI's error shape when the body has one."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:300]
    return f"HTTP {response.status_code}: {message}"


def chunk_text(event: dict, chat: bool) -> str | None:
    choices = event.get("choices") or []
    if not choices:
        return None
    return (choices[0].get("delta") or {}).get("content") if chat else choices[0].get("text")


async def send(client: httpx.AsyncClient, config: BenchConfig, model: str, prompt: str,
               max_tokens: int, stream: bool) -> RequestResult:
    """One request, timed; any failure lands in the result's `error`, never raises."""
    result = RequestResult(model=model)
    body = request_body(config, model, prompt, max_tokens, stream)
    started = time.perf_counter()
    try:
        if stream:
            await _read_stream(client, config, body, result, started)
        else:
            response = await client.post(ENDPOINTS[config.endpoint], json=body)
            if response.status_code != 200:
                raise BenchError(http_error(response))
            result.output_tokens = response.json()["usage"]["completion_tokens"]
            result.usage_counted = True
        result.e2e = time.perf_counter() - started
        result.ok = True
    except (BenchError, httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        result.error = str(exc) or type(exc).__name__
    return result


async def _read_stream(client: httpx.AsyncClient, config: BenchConfig, body: dict,
                       result: RequestResult, started: float) -> None:
    chat, text_chunks, done = config.endpoint == "chat", 0, False
    async with client.stream("POST", ENDPOINTS[config.endpoint], json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise BenchError(http_error(response))
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:  # the server failed after the headers: reported in-band
                raise BenchError(f"in-stream error: {event['error'].get('message')}")
            if chunk_text(event, chat):
                text_chunks += 1
                if result.ttft is None:
                    result.ttft = time.perf_counter() - started
            if event.get("usage"):
                result.output_tokens = event["usage"]["completion_tokens"]
                result.usage_counted = True
    if not done:
        raise BenchError("the stream ended without `data: [DONE]`")
    if not result.usage_counted:  # a server without include_usage: one token per text chunk
        result.output_tokens = text_chunks


async def resolve_models(client: httpx.AsyncClient, config: BenchConfig) -> list[str]:
    """The model ids to benchmark, each checked with a one-token request before the clock
    starts (as vLLM's initial test run): a typo fails fast and cold adapter loads stay out of
    the numbers."""
    try:
        response = await client.get("/v1/models")
    except httpx.TransportError as exc:
        raise BenchError(f"cannot reach {client.base_url}: {exc or type(exc).__name__}; is "
                         "`loragw serve` running there? (leave out --url to start one)") from None
    if response.status_code != 200:
        raise BenchError(f"GET /v1/models: {http_error(response)}")
    try:
        cards = response.json()["data"]
        listed = [card["id"] for card in cards]
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"GET {client.base_url}/v1/models is not an OpenAI model list; is "
                         "this an OpenAI-compatible server?") from None
    base = next((card["id"] for card in cards if card.get("parent") is None), None)
    if base is None and config.adapters in ((), ("all",)):
        raise BenchError("GET /v1/models lists no base model; name the models with --adapters")
    if not config.adapters:
        ids = [base]
    elif config.adapters == ("all",):
        ids = [card["id"] for card in cards if card.get("parent") == base]
        if not ids:
            raise BenchError(f"--adapters all: the server lists no adapters, only {base!r}")
    else:
        ids = list(dict.fromkeys(config.adapters))
    checks = await asyncio.gather(*(send(client, config, model, PROMPTS[0], 1, False)
                                    for model in ids))
    for check in checks:
        if not check.ok:
            raise BenchError(f"model {check.model!r} failed its check request: {check.error} "
                             f"(the server lists: {', '.join(listed)})")
    return ids


async def run(config: BenchConfig, url: str) -> BenchResult:
    rng = random.Random(config.seed)
    limits = httpx.Limits(max_connections=config.concurrency + 1,
                          max_keepalive_connections=config.concurrency)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10)) as client:
        ids = await resolve_models(client, config)
        plan = assign_models(ids, config.num_requests, config.adapter_distribution, rng)
        prompts = [config.prompt] if config.prompt is not None else list(PROMPTS)
        logger.info("benchmark: %d requests to %s, concurrency %d, rate %s/s, models %s",
                    len(plan), url, config.concurrency, config.request_rate, ", ".join(ids))
        in_flight = asyncio.Semaphore(config.concurrency)
        bar = tqdm(total=len(plan), desc="benchmark", unit="req", disable=None)

        async def one(i: int) -> RequestResult:
            async with in_flight:
                result = await send(client, config, plan[i], prompts[i % len(prompts)],
                                    config.max_tokens, config.stream)
            bar.update()
            return result

        started, tasks = time.perf_counter(), []
        for i in range(len(plan)):
            tasks.append(asyncio.create_task(one(i)))
            if i + 1 < len(plan) and config.request_rate != math.inf:
                await asyncio.sleep(rng.expovariate(config.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
        bar.close()
    return summarize(list(results), duration)


def bench_main(config: BenchConfig) -> int:
    """Run the benchmark, print the table, write --json; 0 if every request succeeded."""
    if not logger.isEnabledFor(logging.DEBUG):  # httpx logs each request at INFO: a flood
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        target = (nullcontext(config.url.rstrip("/")) if config.url is not None
                  else serve_subprocess(config.serve_args(), config.api_key))
        with target as url:
            result = asyncio.run(run(config, url))
    except (BenchError, ServerStartError) as exc:
        sys.stderr.write(f"loragw bench: {exc}\n")
        return 1
    sys.stdout.write(format_table(result, config.concurrency, config.request_rate))
    if config.json_path:
        settings = asdict(config) | {
            "request_rate": None if math.isinf(config.request_rate) else config.request_rate,
            "api_key": "<set>" if config.api_key else None}  # no Infinity in JSON; no secrets
        with open(config.json_path, "w") as f:
            json.dump(asdict(result) | {"config": settings}, f, indent=2)
    if result.failed:
        sys.stderr.write(f"loragw bench: {result.failed} of {result.failed + result.completed} "
                         f"requests failed; the first: {result.first_error}\n")
        return 1
    return 0
