"""The many-adapter tail: time per output token p50 / p99 when 32 streams share 16 slots among
128 adapters of Zipf popularity, served over HTTP (and by vLLM's OpenAI server when its CPU
build is given), with the engine driven directly on the same requests to tell the engine's
share of the tail from the HTTP path's and the client's.

    python benchmarks/bench_tail.py [--requests 256] [--concurrency 32] [--slots 16]
                                    [--adapters 128] [--vllm-python /path/to/vllm-venv/bin/python]
                                    [--host-slots 64] [--resident-baseline]
                                    [--json tail.json] [-- extra loragw serve flags]

Workload: the 25M random Llama with the demo tokenizer; --adapters rank-16 all-linear adapters
registered at start (on disk; --max-loras --slots device slots, the default host LRU); request
i asks for adapter k with probability proportional to 1 / (k + 1) (Zipf 1.0, seeded), a prompt
of 32-512 random token ids and 16-128 greedy tokens (uniform, ignore_eos), --concurrency at
a time. TPOT = (e2e - TTFT) / (tokens - 1) per request.

Churn (`--host-slots 64 --resident-baseline --skip-http`): the engine row against the same
requests with every adapter in a device slot of its own from the start.

The engine row drives `LLMEngine.step` in a subprocess with the same concurrency (a request
joins when one finishes) and records each step: its time, decode rows, prefill tokens, and the
slot fills, disk reads and preemptions it made. The step table says what the slow steps held.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # its neighbours

from bench_serving import TARGETS, Run, every_cpu, pct, run_http  # noqa: E402
from common import build_llama25m_with_tokenizer, machine, write_adapters  # noqa: E402

from loragw.gateway.bench.server import free_port  # noqa: E402

logger = logging.getLogger("bench_tail")
PROMPT_MIN, PROMPT_MAX, OUTPUT_MIN, OUTPUT_MAX = 32, 512, 16, 128


def workload(n: int, adapters: int, vocab: int, seed: int = 0) -> list[tuple[str, list[int], int]]:
    """n (adapter, prompt token ids, max_tokens)."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) for k in range(adapters)]
    names = [f"a{k:03d}" for k in rng.choices(range(adapters), weights, k=n)]
    return [(name, [rng.randrange(10, vocab) for _ in range(rng.randint(PROMPT_MIN, PROMPT_MAX))],
             rng.randint(OUTPUT_MIN, OUTPUT_MAX)) for name in names]


ENGINE = r"""
import json, sys, time
from loragw.engine import LLM, SamplingParams
from loragw.engine.llm_engine import EngineRequest
model, adapters, bodies, slots, concurrency, options = json.loads(sys.stdin.read())
llm = LLM(model, device="cpu", dtype="float32", max_loras=slots, max_num_seqs=concurrency,
          max_lora_rank=16, **options)
for i, path in enumerate(adapters):
    llm.add_adapter(f"a{i:03d}", path)
engine = llm.engine
if slots >= len(adapters):  # the all-resident baseline: every adapter in its slot first
    for i in range(len(adapters)):
        engine.to_device(f"a{i:03d}")
llm.generate([p for _, p, _ in bodies[:4]], SamplingParams(max_tokens=4),
             adapters=[a for a, _, _ in bodies[:4]])  # warm-up
stats, sched = engine.lora.stats, engine.scheduler
batches = []
schedule = sched.schedule
def recorded():
    batches.append(schedule())
    return batches[-1]
sched.schedule = recorded
pending = bodies[::-1]
arrival, first, last, counts, steps, gaps = {}, {}, {}, {}, [], []
start = time.perf_counter()
def submit():
    a, p, n = pending.pop()
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    rid, = engine.add_requests([EngineRequest(p, params, a)])
    arrival[rid] = time.perf_counter()
for _ in range(min(concurrency, len(pending))):
    submit()
while engine.has_unfinished():
    before = (stats.device_loads, stats.host_loads, sched.num_preemptions)
    t0 = time.perf_counter()
    outs = engine.step()
    now = time.perf_counter()
    decode, prefill = batches[-1].num_decode, batches[-1].num_tokens - batches[-1].num_decode
    after = (stats.device_loads, stats.host_loads, sched.num_preemptions)
    steps.append([now - t0, decode, prefill, *(b - a for a, b in zip(before, after))])
    for o in outs:
        if o.request_id in last:
            gaps.append(now - last[o.request_id])
        first.setdefault(o.request_id, now)
        last[o.request_id] = now
        counts[o.request_id] = o.num_output_tokens
        if o.finished and pending:
            submit()
wall = time.perf_counter() - start
ids = list(arrival)
print(json.dumps({"wall": wall, "tokens": sum(counts.values()),
                  "ttft": [first[r] - arrival[r] for r in ids],
                  "tpot": [(last[r] - first[r]) / (counts[r] - 1) for r in ids],
                  "itl": gaps, "steps": steps}))
"""


def run_engine(model: str, adapters: list[str], bodies: list, slots: int, concurrency: int,
               options: dict, mode: str = "engine, driven directly") -> tuple[Run, list]:
    spec = [model, adapters, bodies, slots, concurrency, options]
    out = subprocess.run([sys.executable, "-P", "-c", ENGINE], cwd=ROOT, capture_output=True,
                         text=True, input=json.dumps(spec), preexec_fn=every_cpu)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return (Run(mode, r["wall"], r["tokens"], r["ttft"], r["tpot"], r["itl"]),
            r["steps"])


def step_table(steps: list) -> str:
    """Step time by what the step held (ms): p50 / p99 / max and how many such steps."""
    kinds = {"decode only": lambda s: s[2] == 0 and not s[3] and not s[4],
             "with prefill tokens": lambda s: s[2] > 0,
             "with a slot fill": lambda s: s[3] > 0,
             "with a disk read": lambda s: s[4] > 0,
             "with a preemption": lambda s: s[5] > 0}
    lines = ["| steps | count | ms p50 | ms p99 | ms max | prefill tokens p50 / max |",
             "|---|---:|---:|---:|---:|---:|"]
    for kind, test in kinds.items():
        chosen = [s for s in steps if test(s)]
        if not chosen:
            lines.append(f"| {kind} | 0 | | | | |")
            continue
        ms = [s[0] * 1e3 for s in chosen]
        pre = [s[2] for s in chosen]
        lines.append(f"| {kind} | {len(chosen)} | {pct(ms, .5):.1f} | {pct(ms, .99):.1f} | "
                     f"{max(ms):.1f} | {statistics.median(pre):.0f} / {max(pre)} |")
    return "\n".join(lines)


def loragw(model: str, adapters: list[str], port: int, slots: int, concurrency: int,
           extra: list[str]) -> list[str]:
    flags = [a for i, path in enumerate(adapters) for a in ("--adapter", f"a{i:03d}={path}")]
    return [sys.executable, "-P", "-m", "loragw.gateway.server", "--model", model, "--device", "cpu",
            "--max-loras", str(slots), "--max-num-seqs", str(concurrency), "--max-lora-rank",
            "16", "--port", str(port), "--adapter-dir", tempfile.mkdtemp(prefix="bench-tail-"),
            *flags, *extra]


def vllm(python: str, model: str, adapters: list[str], port: int, slots: int,
         concurrency: int) -> list[str]:
    modules = [f"a{i:03d}={path}" for i, path in enumerate(adapters)]
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port",
            str(port), "--dtype", "float32", "--enable-lora", "--max-loras", str(slots),
            "--max-lora-rank", "16", "--max-num-seqs", str(concurrency), "--max-model-len",
            "2048", "--lora-modules", *modules]


def row(run: Run) -> str:
    p50, p99 = pct(run.tpot, .5), pct(run.tpot, .99)
    gaps = run.itl or [0.0]
    return (f"| {run.mode} | {run.tok_s:.0f} | {pct(run.ttft, .5) * 1e3:.0f} / "
            f"{pct(run.ttft, .99) * 1e3:.0f} ms | {p50 * 1e3:.1f} / {p99 * 1e3:.1f} ms | "
            f"{p99 / p50:.1f}x | {pct(gaps, .5) * 1e3:.0f} / {pct(gaps, .99) * 1e3:.0f} / "
            f"{max(gaps) * 1e3:.0f} ms |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=128)
    parser.add_argument("--vllm-python", help="python of a venv with vLLM's CPU build")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--engine-option", action="append", default=[], metavar="NAME=JSON",
                        help="an engine Config option for the engine row (repeatable)")
    parser.add_argument("--host-slots", type=int,
                        help="parsed adapters kept in host memory (max_cpu_loras)")
    parser.add_argument("--resident-baseline", action="store_true",
                        help="also drive the engine with every adapter in a slot of its own: "
                        "what churn costs, side by side")
    parser.add_argument("--json", help="write the runs and the engine's steps here")
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "bench-serving"))
    parser.add_argument("serve_flags", nargs="*", help="extra `loragw serve` flags (after --)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    from transformers import AutoConfig

    model = build_llama25m_with_tokenizer(args.work_dir)
    hf_config = AutoConfig.from_pretrained(model)
    adapters = write_adapters(os.path.join(args.work_dir, "adapters"), hf_config, TARGETS,
                              args.adapters, seed=0)
    bodies = workload(args.requests, args.adapters, hf_config.vocab_size)
    warm = bodies[:1]
    runs, steps, resident_steps = [], None, None
    if not args.skip_engine:
        options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.engine_option)}
        if args.host_slots:
            options["max_cpu_loras"] = args.host_slots
        run, steps = run_engine(model, adapters, bodies, args.slots, args.concurrency, options)
        runs.append(run)
        logger.info("%s", row(run))
        if args.resident_baseline:
            run, resident_steps = run_engine(model, adapters, bodies, args.adapters,
                                             args.concurrency, options,
                                             "engine, every adapter resident")
            runs.append(run)
            logger.info("%s", row(runs[-1]))
    if not args.skip_http:
        port = free_port()
        runs.append(run_http(loragw(model, adapters, port, args.slots, args.concurrency,
                                    args.serve_flags), "/ready", port, bodies, warm,
                             args.concurrency, "loragw serve (HTTP)"))
        logger.info("%s", row(runs[-1]))
    if args.vllm_python:
        port = free_port()
        runs.append(run_http(vllm(args.vllm_python, model, adapters, port, args.slots,
                                  args.concurrency), "/health", port, bodies, warm,
                             args.concurrency, "vLLM OpenAI server (CPU)",
                             env={"VLLM_CPU_KVCACHE_SPACE": "4", "OMP_NUM_THREADS": "2"}))
        logger.info("%s", row(runs[-1]))
    print(f"`python benchmarks/bench_tail.py {' '.join(sys.argv[1:])}`; {machine()}; "
          f"{args.requests} requests, {args.concurrency} streams, {args.adapters} adapters "
          f"(Zipf 1.0), {args.slots} slots\n")
    print("| mode | output tok/s | TTFT p50 / p99 | TPOT p50 / p99 | TPOT p99 / p50 | "
          "inter-token gap p50 / p99 / max |")
    print("|---|---:|---:|---:|---:|---:|")
    for run in runs:
        print(row(run))
    if args.resident_baseline and not args.skip_engine:
        churn, resident = runs[0], runs[1]
        rows = [statistics.mean(s[1] for s in run_steps if s[1]) or 0
                for run_steps in (steps, resident_steps)]
        print(f"\nunder churn / all resident: {churn.tok_s / resident.tok_s:.2f} of the "
              f"throughput, TTFT p99 {pct(churn.ttft, .99) / pct(resident.ttft, .99):.2f}x; "
              f"decoding rows per step {rows[0]:.1f} vs {rows[1]:.1f}")
    if steps:
        print("\nThe engine's steps (driven directly):\n")
        print(step_table(steps))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": [vars(r) for r in runs], "steps": steps}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
