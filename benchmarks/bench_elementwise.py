"""The C norm and rotary kernels against torch's ops, interleaved in one process: the same
engine, weights and requests, its elementwise backend switched between runs (torch, cpu, cpu,
torch, ...), so this machine's drift falls on both alike.

    python benchmarks/bench_elementwise.py [--rounds 4] [--tokens 64] [--dtype bfloat16]

The bench Llama (hidden 512, 8 layers), batch 32 and 128 of 32-token prompts decoding --tokens
greedy tokens, without adapters and with 32 distinct rank-16 adapters on all seven projections
(batch 32 only); per cell the median over rounds of the decode step (ms) and tok/s. --dtype
(float32 by default; bfloat16 measures the kernels' bf16 paths, auto what this CPU serves).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_roofline  # noqa: E402
from bench_roofline import ADAPTERS, RANK, TARGETS, engine_tok_s  # noqa: E402
from common import build_llama25m_with_tokenizer, machine, write_adapters  # noqa: E402

from loragw.engine import LLM  # noqa: E402

CASES = ((32, 0), (32, ADAPTERS), (128, 0))  # (batch, adapters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"))
    ap.add_argument("--root", default=tempfile.gettempdir())
    args = ap.parse_args()
    from transformers import AutoConfig

    model = build_llama25m_with_tokenizer(args.root)
    hf = AutoConfig.from_pretrained(model)
    dirs = write_adapters(os.path.join(args.root, "loragw-bench-llama25m-tok-all7"), hf, TARGETS,
                          ADAPTERS, seed=11, rank=RANK)
    print(f"machine: {machine()}", flush=True)
    rows = []
    for batch, adapters in CASES:
        bench_roofline.BATCH = batch  # engine_tok_s's batch
        llm = LLM(model, device="cpu", max_num_seqs=batch, max_loras=ADAPTERS,
                  max_lora_rank=RANK, max_model_len=512, dtype=args.dtype)
        names = []
        for i, path in enumerate(dirs[:adapters]):
            names.append(f"a{i:02d}")
            llm.add_adapter(names[-1], path)
        runner = llm.engine.runner
        assert runner.backends.elementwise == "cpu", "the C kernels do not serve on this machine"
        kinds = {"torch": dataclasses.replace(runner.backends, elementwise="torch"),
                 "cpu": runner.backends}
        seen = {kind: [] for kind in kinds}
        for r in range(args.rounds):
            for kind in (("torch", "cpu") if r % 2 == 0 else ("cpu", "torch")):
                runner.backends = kinds[kind]
                seen[kind].append(engine_tok_s(llm, names, args.tokens, hf.vocab_size))
                print(batch, adapters, kind, seen[kind][-1], flush=True)
        medians = {k: (statistics.median(t for t, _ in v), statistics.median(s for _, s in v))
                   for k, v in seen.items()}
        rows.append((batch, adapters, medians))
        del llm
    print(f"\n{args.dtype}, {args.rounds} rounds each, interleaved; medians\n")
    print("| batch | adapters | decode step ms: torch ops / C | tok/s: torch ops / C | C / torch tok/s |")
    print("|---:|---:|---:|---:|---:|")
    for batch, adapters, m in rows:
        print(f"| {batch} | {adapters} | {m['torch'][1] * 1e3:.1f} / {m['cpu'][1] * 1e3:.1f} | "
              f"{m['torch'][0]:.0f} / {m['cpu'][0]:.0f} | {m['cpu'][0] / m['torch'][0]:.3f}x |")


if __name__ == "__main__":
    main()
