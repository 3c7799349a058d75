"""What the HTTP layer costs: the same short requests sent to the engine in-process
(EngineClient.submit, on a thread) and through the gateway (uvicorn + Litestar + OpenAI shapes, over loopback),
and the requests/s the gateway sustains when generation is trivial (max_tokens=1).

    python benchmarks/bench_gateway.py [--model DIR] [--requests 200] [--quick]

The server runs in a subprocess (`serve_main`), so client and server do not share a GIL. The
in-process engine (same model and settings) lives in this process; requests alternate between
the two, so both see the same machine load, and the HTTP client is a minimal raw-socket one so
the numbers are the gateway's. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time

import httpx
import torch
from tqdm import tqdm

from loragw.engine.config import Config
from loragw.engine.core.client import EngineClient
from loragw.engine.llm_engine import LLMEngine
from loragw.engine.request.params import SamplingParams
from loragw.gateway.bench.server import free_port, stop_server

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import demo_model  # noqa: E402

PROMPT = "Tell me about the ocean"
SHORT_TOKENS = 8
MODEL_NAME = "bench"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class RawClient:
    """A minimal HTTP/1.1 keep-alive client on asyncio streams, so the numbers below are the
    gateway's cost and not a Python HTTP client's."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict, on_chunk=None) -> bytes:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        payload = json.dumps(body).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: "
                          f"application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
                          .encode() + payload)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
        headers = {k.lower(): v for k, v in headers.items()}
        if b"content-length" in headers:
            data = await self.reader.readexactly(int(headers[b"content-length"]))
        else:  # chunked: one chunk per SSE event
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                if on_chunk is not None:
                    on_chunk()
                parts.append(chunk[:-2])
            data = b"".join(parts)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:300]!r}")
        return data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def measure(llm_engine: LLMEngine, url: str, args) -> dict[str, list[float] | float]:
    """Sequential short requests, in-process and over HTTP interleaved (so both see the same
    machine), then trivial-generation throughput for each, alternating rounds."""
    engine = EngineClient.on_thread(llm_engine)
    try:
        return await _measure(engine, url, args)
    finally:
        await asyncio.to_thread(engine.shutdown)


async def _measure(engine: EngineClient, url: str, args) -> dict[str, list[float] | float]:
    host, port = url.removeprefix("http://").split(":")
    client = RawClient(host, int(port))
    body = {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0, "ignore_eos": True}

    async def local(max_tokens: int) -> tuple[float, float]:
        started, first = time.perf_counter(), None
        async for out in await engine.submit(PROMPT, params(max_tokens)):
            if first is None and out.new_token_ids:
                first = time.perf_counter()
        return time.perf_counter() - started, first - started

    async def remote(max_tokens: int, stream: bool) -> tuple[float, float]:
        started, first = time.perf_counter(), []

        def mark():
            if not first:
                first.append(time.perf_counter())

        await client.post("/v1/completions", body | {"max_tokens": max_tokens, "stream": stream},
                          mark)
        ended = time.perf_counter()
        return ended - started, (first[0] if first else ended) - started

    samples: dict[str, list[float]] = {k: [] for k in ("local", "local_ttft", "whole", "stream",
                                                       "stream_ttft")}
    for i in tqdm(range(args.warmup + args.requests), desc="sequential requests", disable=None):
        e2e, ttft = await local(SHORT_TOKENS)
        whole, _ = await remote(SHORT_TOKENS, stream=False)
        stream, stream_ttft = await remote(SHORT_TOKENS, stream=True)
        if i >= args.warmup:
            for key, value in (("local", e2e), ("local_ttft", ttft), ("whole", whole),
                               ("stream", stream), ("stream_ttft", stream_ttft)):
                samples[key].append(value)
    client.close()

    async def rps(one) -> float:
        sem = asyncio.Semaphore(args.concurrency)

        async def bounded():
            async with sem:
                await one()

        started = time.perf_counter()
        await asyncio.gather(*(bounded() for _ in range(args.trivial_requests)))
        return args.trivial_requests / (time.perf_counter() - started)

    clients = [RawClient(host, int(port)) for _ in range(args.concurrency)]

    async def trivial_remote():
        c = clients.pop()
        try:
            await c.post("/v1/completions", body | {"max_tokens": 1})
        finally:
            clients.append(c)

    local_rps, remote_rps = [], []
    for _ in range(3):
        local_rps.append(await rps(lambda: local(1)))
        remote_rps.append(await rps(trivial_remote))
    for c in clients:
        c.close()
    return samples | {"local_rps": statistics.median(local_rps),
                      "remote_rps": statistics.median(remote_rps)}


def start_server(model: str, max_num_seqs: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    code = ("import sys; from loragw.gateway.server import serve_main; "
            "sys.exit(serve_main(sys.argv[1:]))")
    proc = subprocess.Popen(
        [sys.executable, "-P", "-c", code, "--model", model, "--served-model-name", MODEL_NAME,
         "--port", str(port), "--device", "cpu", "--max-num-seqs", str(max_num_seqs)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not become ready in 120 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model dir (default: the demo model, built if missing)")
    parser.add_argument("--requests", type=int, default=200, help="sequential requests per mode")
    parser.add_argument("--trivial-requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="50 / 100 requests")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.trivial_requests = 50, 100
    logging.basicConfig(level=logging.WARNING)
    model = demo_model(args.model)

    proc, url = start_server(model, args.concurrency)
    llm_engine = LLMEngine(Config(model=model, device="cpu", max_num_seqs=args.concurrency))
    try:
        result = asyncio.run(measure(llm_engine, url, args))
    finally:
        stop_server(proc)

    ms = 1e3
    r = result
    rows = [("whole response, e2e", r["local"], r["whole"]),
            ("stream, time to first chunk", r["local_ttft"], r["stream_ttft"]),
            ("stream, e2e", r["local"], r["stream"])]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\n{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, load "
          f"average {load} at the end; {args.requests} sequential requests of {SHORT_TOKENS} "
          "tokens per mode\n")
    print("| request | in-process p50 | HTTP p50 | added p50 | in-process p99 | HTTP p99 "
          "| added p99 |")
    print("|---|---|---|---|---|---|---|")
    for name, a, b in rows:
        p50a, p50b, p99a, p99b = (percentile(a, 0.5), percentile(b, 0.5), percentile(a, 0.99),
                                  percentile(b, 0.99))
        print(f"| {name} | {p50a * ms:.2f} ms | {p50b * ms:.2f} ms | {(p50b - p50a) * ms:+.2f} ms "
              f"| {p99a * ms:.2f} ms | {p99b * ms:.2f} ms | {(p99b - p99a) * ms:+.2f} ms |")
    per_token = (statistics.median(r["stream"]) - statistics.median(r["whole"])) / SHORT_TOKENS
    print(f"\nstreaming cost per token beyond a whole response (median difference / "
          f"{SHORT_TOKENS} tokens): {per_token * ms:.3f} ms")
    print(f"\n| trivial generation (max_tokens=1, concurrency {args.concurrency}) | requests/s |")
    print("|---|---|")
    print(f"| in-process | {r['local_rps']:.0f} |")
    print(f"| HTTP (gateway) | {r['remote_rps']:.0f} |")


if __name__ == "__main__":
    main()
