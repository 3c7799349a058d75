"""Time per decode step of a 32-request batch on the demo model with 0%, 50% and 100% of the
rows under a grammar (xgrammar masks filled on a worker thread during the forward pass).
Constrained rows use a regex of 1000 lowercase letters and spaces, so none ends early.

    .venv/bin/python -m benchmarks.bench_structured [--steps 40]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

from tqdm import tqdm

from engine import LLM
from engine.demo import build_demo_model
from engine.sampling_params import SamplingParams
from engine.structured import GuidedDecoding

BATCH = 32
REGEX = "[a-z ]{1000}"  # longer than any run: no row ends early


def step_times(llm: LLM, constrained: int, steps: int) -> list[float]:
    engine = llm.engine
    for i in range(BATCH):
        guided = GuidedDecoding("regex", REGEX) if i < constrained else None
        engine.add_request(f"request {i}:", SamplingParams(max_tokens=steps + 8, temperature=1.0,
                                                           ignore_eos=True, guided=guided))
    while any(s.num_output_tokens == 0 for r in engine.requests.values() for s in [r.seq]):
        engine.step()  # prefill
    times = []
    for _ in tqdm(range(steps), desc=f"{constrained}/{BATCH} constrained", leave=False):
        assert engine.num_running == BATCH, "a row finished early: the step would be smaller"
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    llm = LLM(build_demo_model(tempfile.mkdtemp()), max_num_seqs=BATCH, max_model_len=512)
    step_times(llm, BATCH, 4)  # warm up: compile the grammar, touch every code path
    rows = []
    for constrained in (0, BATCH // 2, BATCH):
        rows.append((constrained, statistics.median(step_times(llm, constrained, args.steps))))
    base = rows[0][1]
    print(f"| constrained rows (of {BATCH}) | median decode step (ms) | vs unconstrained |")
    print("|---|---|---|")
    for constrained, t in rows:
        print(f"| {constrained} ({100 * constrained // BATCH}%) | {t * 1e3:.2f} | "
              f"{100 * (t / base - 1):+.1f}% |")


if __name__ == "__main__":
    main()
