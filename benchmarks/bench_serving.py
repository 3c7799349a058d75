"""Serving throughput under concurrent streams: `loragw serve` against the same engine offline,
on the same requests, in one run (and vLLM's OpenAI server when its CPU build is given).

    python benchmarks/bench_serving.py [--requests 96] [--concurrency 32] [--rounds 2]
                                       [--vllm-python /path/to/vllm-venv/bin/python]
                                       [--engine-cpus 0]

Workload (issue 17): the 25M random Llama with the demo tokenizer, 32 distinct rank-16
all-linear adapters, --max-loras 32 --max-num-seqs 32; 96 requests, 32 at a time, 32-token
prompts (token ids), 64 greedy tokens each with ignore_eos, request i on adapter i % 32.
HTTP: an external streaming httpx client in this process (the server is a subprocess);
offline: `LLM.generate` in a subprocess of its own. Reported per mode: output tok/s, TTFT and
TPOT p50/p99 (TPOT = (e2e - TTFT) / (tokens - 1) per request), server CPU seconds per output
token (utime + stime of the server's processes), and for offline the median step time at batch
32. Rounds alternate the modes; the best round of each is kept. With --engine-cpus the server
pins its engine process there and its HTTP process elsewhere, the offline engine runs on the
same CPUs, and this client on the others: the engine's CPUs are its own in both modes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # its neighbours

from common import build_llama25m_with_tokenizer, machine, write_adapters  # noqa: E402

from loragw.gateway.bench.server import free_port, stop_server  # noqa: E402

logger = logging.getLogger("bench_serving")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NUM_ADAPTERS, PROMPT_LEN, MAX_TOKENS = 32, 32, 64
ALL_CPUS = os.sched_getaffinity(0)


def every_cpu() -> None:
    """In a server or offline child: start from every CPU (this client may be pinned)."""
    os.sched_setaffinity(0, ALL_CPUS)


@dataclass
class Run:
    mode: str
    wall_s: float
    tokens: int
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)  # gaps between a stream's text chunks
    server_cpu_s: float | None = None
    step_ms: float | None = None

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


def prompts(n: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(10, vocab) for _ in range(PROMPT_LEN)] for _ in range(n)]


# ---- offline ------------------------------------------------------------------------------
OFFLINE = r"""
import json, statistics, sys, time
from loragw.engine import LLM, SamplingParams
from loragw.engine.llm_engine import EngineRequest
model, adapters, prompts, cpus = json.loads(sys.stdin.read())
if cpus:  # the CPUs `loragw serve --engine-cpus` gives its engine process
    import torch
    from loragw.engine.core import pin_threads
    pin_threads(set(cpus))
    torch.set_num_threads(len(cpus))
llm = LLM(model, device="cpu", dtype="float32", max_loras=32, max_num_seqs=32, max_lora_rank=16)
for i, path in enumerate(adapters):
    llm.add_adapter(f"a{i:02d}", path)
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
names = [f"a{i % len(adapters):02d}" for i in range(len(prompts))]
llm.generate(prompts[:32], params, adapters=names[:32])  # warm-up: every adapter in a slot
engine = llm.engine
ids = engine.add_requests([EngineRequest(p, params, a) for p, a in zip(prompts, names)])
arrival, first, last, counts, steps = time.perf_counter(), {}, {}, {}, []
while engine.has_unfinished():
    t0 = time.perf_counter()
    running = engine.scheduler.running  # a decode-only step at batch 32?
    full = len(running) == 32 and all(s.num_output_tokens > 0 for s in running)
    outs = engine.step()
    now = time.perf_counter()
    if full:
        steps.append(now - t0)
    for o in outs:
        first.setdefault(o.request_id, now)
        last[o.request_id] = now
        counts[o.request_id] = o.num_output_tokens
wall = time.perf_counter() - arrival
print(json.dumps({"wall": wall, "tokens": sum(counts.values()),
                  "ttft": [first[r] - arrival for r in ids],
                  "tpot": [(last[r] - first[r]) / (counts[r] - 1) for r in ids],
                  "step_ms": 1e3 * statistics.median(steps)}))
"""


def run_offline(model: str, adapters: list[str], requests: list[list[int]],
                cpus: list[int]) -> Run:
    out = subprocess.run([sys.executable, "-P", "-c", OFFLINE], cwd=ROOT, capture_output=True,
                         text=True, input=json.dumps([model, adapters, requests, cpus]),
                         check=True, preexec_fn=every_cpu)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return Run("offline LLM.generate", r["wall"], r["tokens"], r["ttft"], r["tpot"],
               step_ms=r["step_ms"])


# ---- HTTP ---------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its children so far (all its threads)."""
    import psutil

    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


async def one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
              run: Run) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    started, first, last, tokens = time.perf_counter(), None, None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["text"]:
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    run.itl.append(now - last)
                last = now
    end = time.perf_counter()
    run.tokens += tokens
    run.ttft.append(first - started)
    run.tpot.append((end - first) / max(tokens - 1, 1))


Body = tuple[str, list[int], int]  # model, prompt token ids, max_tokens


async def drive(url: str, bodies: list[Body], warm: list[Body], concurrency: int, mode: str,
                pid: int | None) -> Run:
    """`warm` first (all at once, not timed), then `bodies`, `concurrency` at a time."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await asyncio.gather(*(one(client, *body, Run("warm-up", 1, 0)) for body in warm))
        run, gate = Run(mode, 0.0, 0), asyncio.Semaphore(concurrency)
        cpu0 = cpu_seconds(pid) if pid else None

        async def gated(body: Body):
            async with gate:
                await one(client, *body, run)

        started = time.perf_counter()
        await asyncio.gather(*(gated(body) for body in bodies))
        run.wall_s = time.perf_counter() - started
        if pid:
            run.server_cpu_s = cpu_seconds(pid) - cpu0
    return run


def run_http(command: list[str], ready_path: str, port: int, bodies: list[Body],
             warm: list[Body], concurrency: int, mode: str, env: dict | None = None) -> Run:
    log = tempfile.NamedTemporaryFile(prefix="bench-serving-", suffix=".log", delete=False)
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, preexec_fn=every_cpu)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 600
        while True:
            assert proc.poll() is None, Path(log.name).read_text()[-3000:]
            assert time.monotonic() < deadline, "the server never became ready"
            try:
                if httpx.get(url + ready_path, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        return asyncio.run(drive(url, bodies, warm, concurrency, mode, proc.pid))
    finally:
        stop_server(proc)


def loragw(model: str, adapters: list[str], port: int, engine_cpus: str | None) -> list[str]:
    flags = [a for i, path in enumerate(adapters) for a in ("--adapter", f"a{i:02d}={path}")]
    if engine_cpus:
        flags += ["--engine-cpus", engine_cpus]
    return [sys.executable, "-P", "-m", "loragw.gateway.server", "--model", model, "--device", "cpu",
            "--max-loras", "32", "--max-num-seqs", "32", "--max-lora-rank", "16",
            "--port", str(port), "--adapter-dir", tempfile.mkdtemp(prefix="bench-store-"),
            *flags]


def vllm(python: str, model: str, adapters: list[str], port: int) -> list[str]:
    modules = [f"a{i:02d}={path}" for i, path in enumerate(adapters)]
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port",
            str(port), "--dtype", "float32", "--enable-lora", "--max-loras", "32",
            "--max-lora-rank", "16", "--max-num-seqs", "32", "--max-model-len", "2048",
            "--lora-modules", *modules]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def table(runs: dict[str, Run]) -> str:
    offline = runs["offline LLM.generate"]
    lines = ["| mode | output tok/s | vs offline | TTFT p50 / p99 | TPOT p50 / p99 | "
             "server CPU s / token |", "|---|---:|---:|---:|---:|---:|"]
    for run in runs.values():
        cpu = f"{run.server_cpu_s / run.tokens * 1e3:.2f} ms" if run.server_cpu_s else "-"
        lines.append(
            f"| {run.mode} | {run.tok_s:.0f} | {run.tok_s / offline.tok_s:.2f} | "
            f"{pct(run.ttft, .5) * 1e3:.0f} / {pct(run.ttft, .99) * 1e3:.0f} ms | "
            f"{pct(run.tpot, .5) * 1e3:.1f} / {pct(run.tpot, .99) * 1e3:.1f} ms | {cpu} |")
    lines.append(f"\noffline median decode step at batch 32: {offline.step_ms:.1f} ms")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vllm-python", help="python of a venv with vLLM's CPU build")
    parser.add_argument("--engine-cpus", help="CPU list for `loragw serve --engine-cpus` and "
                        "the offline engine; the HTTP server and this client run on the others")
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "bench-serving"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from transformers import AutoConfig

    model = build_llama25m_with_tokenizer(args.work_dir)
    hf_config = AutoConfig.from_pretrained(model)
    adapters = write_adapters(os.path.join(args.work_dir, "adapters"), hf_config, TARGETS,
                              NUM_ADAPTERS, seed=0)
    requests = prompts(args.requests, hf_config.vocab_size)
    names = [f"a{i % NUM_ADAPTERS:02d}" for i in range(args.requests)]
    bodies = [(n, p, MAX_TOKENS) for n, p in zip(names, requests)]
    warm = bodies[:NUM_ADAPTERS]  # every adapter in a slot before the timed requests
    cpus: list[int] = []
    if args.engine_cpus:
        from loragw.gateway.common.config import parse_cpu_list

        cpus = sorted(parse_cpu_list(args.engine_cpus))
        os.sched_setaffinity(0, os.sched_getaffinity(0) - set(cpus))  # the client's CPUs
    best: dict[str, Run] = {}
    for round_ in range(args.rounds):
        port = free_port()
        candidates = [run_offline(model, adapters, requests, cpus),
                      run_http(loragw(model, adapters, port, args.engine_cpus), "/ready", port, bodies,
                               warm, args.concurrency, "loragw serve (HTTP)")]
        if args.vllm_python:
            port = free_port()
            candidates.append(run_http(
                vllm(args.vllm_python, model, adapters, port), "/health", port, bodies,
                warm, args.concurrency, "vLLM OpenAI server (CPU)",
                env={"VLLM_CPU_KVCACHE_SPACE": "4", "OMP_NUM_THREADS": "2"}))
        for run in candidates:
            logger.info("round %d %s: %.0f tok/s", round_, run.mode, run.tok_s)
            if run.mode not in best or run.tok_s > best[run.mode].tok_s:
                best[run.mode] = run
    print(f"`python benchmarks/bench_serving.py {' '.join(sys.argv[1:])}`; {machine()}; "
          f"{args.requests} requests, {args.concurrency} concurrent, best of {args.rounds}\n")
    print(table(best))
    return 0


if __name__ == "__main__":
    sys.exit(main())
