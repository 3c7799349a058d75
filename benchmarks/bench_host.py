"""The host's share of a decode step at a large batch: what the engine does around the forward
pass, per phase, at --batch rows (default 128) of the bench Llama.

    python benchmarks/bench_host.py [--batch 128] [--steps 60] [--adapters 0] [--no-text]

Phases, medians over --steps decode-only steps (after a warm-up):
    schedule   Scheduler.schedule (admission, KV blocks, budgets)
    prepare    LoRA rows + the model runner's step inputs (decode buffers, attention metadata)
    forward    the model's forward pass and logits (not host work: for scale)
    sample     the sampler (greedy here), including its host copy of the tokens
    outputs    the rest of the step: appending tokens, detokenizing, stop checks, outputs
host = schedule + prepare + sample + outputs. Requests ask for text (a detokenizer each), as
served requests do; --no-text drops their detokenizers, which prices detokenizing by difference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_llama25m_with_tokenizer, machine, timed, write_adapters  # noqa: E402

from loragw.engine import LLM, SamplingParams  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--adapters", type=int, default=0, help="distinct adapters over the rows")
    ap.add_argument("--no-text", action="store_true", help="token ids only: no detokenizing")
    ap.add_argument("--root", default=tempfile.gettempdir())
    args = ap.parse_args()
    from transformers import AutoConfig

    model = build_llama25m_with_tokenizer(args.root)
    hf = AutoConfig.from_pretrained(model)
    llm = LLM(model, device="cpu", dtype="float32", max_num_seqs=args.batch,
              max_loras=max(args.adapters, 1), max_model_len=512)
    names = []
    if args.adapters:
        dirs = write_adapters(os.path.join(args.root, "loragw-bench-llama25m-tok-all7"), hf,
                              TARGETS, args.adapters, seed=11)
        for i, path in enumerate(dirs):
            names.append(f"a{i:02d}")
            llm.add_adapter(names[-1], path)
    engine, runner = llm.engine, llm.engine.runner
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.steps + 20, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        prompt = torch.randint(10, hf.vocab_size, (32,), generator=g).tolist()
        engine.add_request(prompt, params, adapter=names[i % len(names)] if names else None)
    if args.no_text:
        for request in engine.requests.values():
            request.detokenizer = None
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.num_waiting:
        engine.step()  # every prompt prefilled: what follows is decode only
    for _ in range(5):
        engine.step()

    now: dict[str, float] = defaultdict(float)

    originals = (engine.scheduler.schedule, engine.lora.prepare, runner.prepare, runner.forward,
                 engine.sampler)
    engine.scheduler.schedule = timed(now, "schedule", originals[0])
    engine.lora.prepare = timed(now, "prepare", originals[1])
    runner.prepare = timed(now, "prepare", originals[2])
    runner.forward = timed(now, "forward", originals[3])
    engine.sampler = timed(now, "sample", originals[4])
    phases = defaultdict(list)
    for _ in range(args.steps):
        now.clear()
        start = time.perf_counter()
        engine.step()
        total = time.perf_counter() - start
        for part in ("schedule", "prepare", "forward", "sample"):
            phases[part].append(now[part])
        phases["outputs"].append(total - sum(now.values()))
        phases["host"].append(total - now["forward"])
    print(f"`python benchmarks/bench_host.py {' '.join(sys.argv[1:])}`; {machine()}; batch "
          f"{args.batch}, {args.adapters} adapters, median of {args.steps} decode steps\n")
    print("| " + " | ".join(phases) + " |")
    print("|" + "---:|" * len(phases))
    print("| " + " | ".join(f"{statistics.median(v) * 1e3:.2f} ms" for v in phases.values())
          + " |")


if __name__ == "__main__":
    main()
