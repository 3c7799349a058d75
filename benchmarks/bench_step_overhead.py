"""Host time per decode step, split by part, on a model whose compute is negligible: a random
Llama with 32 layers of hidden 64 (realistic layer count, ~no FLOPs), so what remains is the
Python and small-op cost a GPU would wait on. Batch 1/32/128, without adapters and with 32
distinct adapters (every row its own).

    python benchmarks/bench_step_overhead.py [--steps 40] [--batches 1,32,128] [--out FILE]
        [--device cuda]   (on a GPU: eager, with CUDA graphs, and with graphs and
                           --async-scheduling; sample then includes the wait for the device,
                           its one synchronisation per step, which async scheduling moves to
                           "rest": the read of the step before's tokens)

Parts of LLMEngine.step, timed by wrapping the methods that do them:
    schedule    Scheduler.schedule
    prepare     LoRAManager.prepare + ModelRunner.prepare (token ids, positions, KV addressing,
                LoRA meta into the step's buffers)
    forward     ModelRunner.forward: the layers' kernel launches; divided by the layer count it
                is the per-layer dispatch cost that CUDA graphs remove
    sample      Sampler.__call__ / Sampler.tokens (incl. the one device-to-host copy of the
                tokens, when the step reads them at once)
    detokenize  IncrementalDetokenizer.step / step_token / flush
    rest        step total minus the above (outputs, finish checks, block bookkeeping)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_random_llama, machine, write_adapters  # noqa: E402

from loragw.engine import LLM, SamplingParams  # noqa: E402
from loragw.engine.request.detokenizer import IncrementalDetokenizer  # noqa: E402

LAYERS, HIDDEN = 32, 64
PARTS = ("schedule", "prepare", "forward", "sample", "detokenize")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_model(root: str) -> str:
    """The 32-layer hidden-64 Llama with the demo model's tokenizer (real detokenization)."""
    from loragw.demo.model import build_demo_model

    demo = build_demo_model(os.path.join(root, "loragw-bench-demo"))
    with open(os.path.join(demo, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    path = build_random_llama(os.path.join(root, f"loragw-bench-l32h64-v{vocab}"), hidden=HIDDEN,
                              layers=LAYERS, heads=4, kv_heads=2, intermediate=128, vocab=vocab)
    for name in os.listdir(demo):
        if name.startswith(("tokenizer", "generation_config")) or name.endswith(".jinja"):
            shutil.copy(os.path.join(demo, name), path)
    return path


class Clock:
    """Accumulates nanoseconds per part; `wrap` times a bound method or a class's function."""

    def __init__(self):
        self.ns = dict.fromkeys(PARTS, 0)
        self.active: set[str] = set()  # parts being timed: a nested call of one counts once

    def wrap(self, owner, name: str, part: str) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            if part in self.active:
                return inner(*args, **kwargs)
            self.active.add(part)
            start = time.perf_counter_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                self.ns[part] += time.perf_counter_ns() - start
                self.active.discard(part)
        setattr(owner, name, timed)

    def take(self) -> dict[str, int]:
        taken, self.ns = self.ns, dict.fromkeys(PARTS, 0)
        return taken


def measure(llm: LLM, clock: Clock, batch: int, adapters: list[str], steps: int) -> dict[str, float]:
    """Median ms per decode step for each part, over `steps` decode-only steps of `batch` rows."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(10, engine.vocab_size, (16,), generator=g).tolist()
        engine.add_request(prompt, params, adapter=adapters[i % len(adapters)] if adapters else None)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.waiting:  # prefill everything first
        engine.step()
    clock.take()
    samples = []
    for _ in range(steps):
        start = time.perf_counter_ns()
        engine.step()
        total = time.perf_counter_ns() - start
        parts = clock.take()
        parts["rest"] = total - sum(parts.values())
        parts["total"] = total
        samples.append(parts)
    for request_id in list(engine.requests):
        engine.abort(request_id)
    engine.drain_aborted()
    return {k: statistics.median(s[k] for s in samples) / 1e6 for k in samples[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--root", default=tempfile.gettempdir())
    ap.add_argument("--out", help="also write the markdown table here")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)  # host overhead is single-threaded; threads only add noise here
    model = build_model(args.root)
    from transformers import AutoConfig

    dirs = write_adapters(os.path.join(args.root, "loragw-bench-l32h64-adapters"),
                          AutoConfig.from_pretrained(model), TARGETS, args.adapters, seed=7, rank=8)
    batches = [int(b) for b in args.batches.split(",")]
    # (enforce_eager, async_scheduling)
    modes = [(True, False)] if args.device == "cpu" else [(True, False), (False, False),
                                                          (False, True)]
    rows = []
    for eager, pipelined in modes:
        llm = LLM(model, max_num_seqs=max(batches), max_loras=args.adapters, max_lora_rank=8,
                  max_model_len=256, max_num_batched_tokens=max(2048, 16 * max(batches)),
                  enable_prefix_caching=False, device=args.device, enforce_eager=eager,
                  async_scheduling=pipelined)
        mode = ("eager" if llm.engine.runner.graphs is None else "graphs") + (
            ", async scheduling" if pipelined else "")
        rows += [(mode, *row) for row in run_batches(llm, batches, dirs, args.steps)]
        del llm
    lines = [f"Machine: {machine()}; device {args.device}; "
             f"model: random Llama, {LAYERS} layers, hidden {HIDDEN}; {args.steps} decode steps "
             "per row (median ms per step).", "",
             "| decode | batch | adapters | schedule | prepare | forward | forward / layer | "
             "sample | detokenize | rest | total | schedule+prepare+sample+detok |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, batch, n, ms, host in rows:
        lines.append(f"| {mode} | {batch} | {n} | {ms['schedule']:.3f} | {ms['prepare']:.3f} | "
                     f"{ms['forward']:.2f} | {ms['forward'] / LAYERS * 1000:.0f} µs | "
                     f"{ms['sample']:.3f} | {ms['detokenize']:.3f} | {ms['rest']:.3f} | "
                     f"{ms['total']:.2f} | **{host:.3f}** |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


def run_batches(llm: LLM, batches: list[int], dirs: list[str], steps: int):
    """(batch, adapters, ms per part, host ms) for each batch, without and with adapters."""
    names = []
    for k, path in enumerate(dirs):
        names.append(f"a{k:02d}")
        llm.engine.add_adapter(names[-1], path)
    engine, clock = llm.engine, Clock()
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(engine.lora, "prepare", "prepare")
    clock.wrap(engine.runner, "prepare", "prepare")
    clock.wrap(engine.runner, "forward", "forward")
    # Looked up on the type (engine.sampler(...), detokenizers made per request): wrapped
    # there, and unwrapped at the end.
    classes = ((type(engine.sampler), "__call__", "sample"),
               (type(engine.sampler), "tokens", "sample"),
               (IncrementalDetokenizer, "step", "detokenize"),
               (IncrementalDetokenizer, "step_token", "detokenize"),
               (IncrementalDetokenizer, "flush", "detokenize"))
    for owner, name, part in classes:
        clock.wrap(owner, name, part)

    rows = []
    for batch in batches:
        for adapters in ([], names):
            measure(llm, clock, batch, adapters, 5)  # warm-up
            ms = measure(llm, clock, batch, adapters, steps)
            host = ms["schedule"] + ms["prepare"] + ms["sample"] + ms["detokenize"]
            rows.append((batch, len(adapters), ms, host))
    for owner, name, _ in classes:
        setattr(owner, name, getattr(owner, name).__wrapped__)
    return rows


if __name__ == "__main__":
    main()
