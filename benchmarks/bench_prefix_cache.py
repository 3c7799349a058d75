"""Prefill with automatic prefix caching on vs off: N requests that share a long system prefix
(default 512 tokens) and differ in a short suffix, on the random ~25M Llama (float32, CPU).

    .venv/bin/python benchmarks/bench_prefix_cache.py [--requests 16] [--prefix 512] [--rounds 2]

Each request generates one token, so its time to first token is its prefill. Two arrival
patterns: `sequential` (each request arrives when the previous one has finished, as chat turns
do) and `burst` (all at once; the first ones admitted compute the prefix, later admissions and
chunks share it). Every run gets a fresh engine, so the first request always finds a cold cache.
On and off alternate round by round, so machine drift lands on both alike; medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_random_llama, machine  # noqa: E402

from loragw.engine import LLM, SamplingParams  # noqa: E402

SUFFIX = 32
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@dataclass
class Run:
    wall: float  # seconds from the first arrival to the last first token
    ttfts: list[float]
    prompt_tokens: int
    cached_tokens: int


def make_prompts(n: int, prefix_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(10, vocab, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(10, vocab, (SUFFIX,), generator=g).tolist() for _ in range(n)]


def run(llm: LLM, prompts: list[list[int]], sequential: bool) -> Run:
    engine = llm.engine
    ttfts, cached = [], 0
    start = time.perf_counter()
    waves = [[p] for p in prompts] if sequential else [prompts]
    for wave in waves:
        arrived = time.perf_counter()
        for prompt in wave:
            engine.add_request(prompt, FIRST_TOKEN)
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids:
                    ttfts.append(time.perf_counter() - arrived)
                    cached += out.num_cached_tokens
    return Run(time.perf_counter() - start, ttfts, sum(map(len, prompts)), cached)


def vocab_size(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["vocab_size"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(),
                                                            "loragw-bench-llama25m"))
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=512, help="shared prefix, in tokens")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    path = build_random_llama(args.model_dir)
    block_size = 16
    per_request = -(-(args.prefix + SUFFIX + 1) // block_size)
    options = dict(device="cpu", dtype="float32", block_size=block_size,
                   max_num_seqs=args.requests, num_kv_blocks=args.requests * per_request + 8)
    vocab = vocab_size(path)
    for caching in (False, True):  # first-call costs (allocator, each shape's kernels) untimed
        for sequential in (True, False):
            run(LLM(path, enable_prefix_caching=caching, **options),
                make_prompts(4, args.prefix, vocab, seed=99), sequential)

    results: dict[tuple[str, bool], list[Run]] = {}
    plan = [(pattern, caching, r) for r in range(args.rounds)
            for pattern in ("sequential", "burst") for caching in (False, True)]
    for pattern, caching, r in tqdm(plan, desc="runs"):
        llm = LLM(path, enable_prefix_caching=caching, **options)
        prompts = make_prompts(args.requests, args.prefix, vocab, seed=r)
        results.setdefault((pattern, caching), []).append(run(llm, prompts, pattern == "sequential"))

    print(f"\nmachine: {machine()}; model: random Llama ~25M params, float32; "
          f"{args.requests} requests x ({args.prefix} shared + {SUFFIX} own) tokens, "
          f"block size {block_size}; medians of {args.rounds} rounds")
    print("| arrivals | prefix caching | prompt tok/s | mean TTFT ms | p50 TTFT ms | "
          "max TTFT ms | cached prompt tokens | speed-up |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for pattern in ("sequential", "burst"):
        off_wall = statistics.median(r.wall for r in results[(pattern, False)])
        for caching in (False, True):
            runs = results[(pattern, caching)]
            wall = statistics.median(r.wall for r in runs)
            ttfts = [statistics.median(sorted(r.ttfts)[i] for r in runs)
                     for i in range(args.requests)]
            mean = statistics.median(statistics.fmean(r.ttfts) for r in runs)
            cached = runs[0].cached_tokens / runs[0].prompt_tokens
            print(f"| {pattern} | {'on' if caching else 'off'} | "
                  f"{runs[0].prompt_tokens / wall:.0f} | {mean * 1e3:.1f} | "
                  f"{statistics.median(ttfts) * 1e3:.1f} | {max(ttfts) * 1e3:.1f} | "
                  f"{cached:.0%} | {off_wall / wall:.2f}x |")


if __name__ == "__main__":
    main()
