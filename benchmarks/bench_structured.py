"""Time per decode step of a 32-request batch on the demo model with 0%, 50% and 100% of the
rows under a grammar (xgrammar masks filled on a worker thread during the forward pass).
Constrained rows use a grammar that cannot end within the run, so the batch stays full:
`--grammar regex` 1000 lowercase letters and spaces, `--grammar json` a JSON array of at least
300 objects {"id": integer, "tag": enum, "name": string}.

    .venv/bin/python benchmarks/bench_structured.py [--steps 40] [--rounds 5] [--grammar json]
        [--model demo|llama25m]

`--model llama25m` is the engine benchmark's random Llama (hidden 512, 8 layers) with the demo
tokenizer's vocabulary and files, for a step closer to a real model's; `demo` (4.5M params,
~5 ms steps on 2 cores) is the hardest case for hiding mask work.

The three settings run in turn, round after round, so slow drift of the machine (other
processes, frequency) lands on all three alike; each median is over every round's steps.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time

from common import build_llama25m_with_tokenizer
from tqdm import tqdm

from loragw.demo.model import build_demo_model
from loragw.engine import LLM
from loragw.engine.request.params import SamplingParams
from loragw.engine.request.structured import GuidedDecoding

BATCH = 32
GRAMMARS = {  # longer than any run: no row ends early
    "regex": GuidedDecoding("regex", "[a-z ]{1000}"),
    "json": GuidedDecoding("json_schema", {"type": "array", "minItems": 300, "items": {
        "type": "object", "properties": {"id": {"type": "integer"},
                                         "tag": {"enum": ["red", "green", "blue"]},
                                         "name": {"type": "string", "maxLength": 12}},
        "required": ["id", "tag", "name"]}}),
}


def build_model(name: str) -> str:
    demo = build_demo_model(os.path.join(tempfile.gettempdir(), "loragw-bench-demo"))
    return demo if name == "demo" else build_llama25m_with_tokenizer()


def step_times(llm: LLM, constrained: int, steps: int, grammar: GuidedDecoding) -> list[float]:
    engine = llm.engine
    for i in range(BATCH):
        guided = grammar if i < constrained else None
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
    parser.add_argument("--steps", type=int, default=40, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--grammar", choices=sorted(GRAMMARS), default="regex")
    parser.add_argument("--model", choices=("demo", "llama25m"), default="demo")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    llm = LLM(build_model(args.model), max_num_seqs=BATCH, max_model_len=512)
    grammar = GRAMMARS[args.grammar]
    step_times(llm, BATCH, 4, grammar)  # warm up: compile the grammar, touch every code path
    settings = (0, BATCH // 2, BATCH)
    times: dict[int, list[float]] = {c: [] for c in settings}
    for _ in range(args.rounds):
        for constrained in settings:
            times[constrained] += step_times(llm, constrained, args.steps, grammar)
    rows = [(c, statistics.median(times[c])) for c in settings]
    base = rows[0][1]
    print(f"| constrained rows (of {BATCH}) | median decode step (ms) | vs unconstrained |")
    print("|---|---|---|")
    for constrained, t in rows:
        print(f"| {constrained} ({100 * constrained // BATCH}%) | {t * 1e3:.2f} | "
              f"{100 * (t / base - 1):+.1f}% |")


if __name__ == "__main__":
    main()
