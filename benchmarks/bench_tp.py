"""Tensor parallelism on this machine: decode step time at TP=1 and TP=2 (gloo), and the
bytes each decode step moves between ranks, counted on rank 0's collectives.

    python benchmarks/bench_tp.py [--batch 32] [--adapters 8] [--steps 20]

On a 2-core CPU only the correctness is meaningful (two ranks share two cores, and gloo moves
tensors through loopback TCP); the bytes per step are the real figure, the same on a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_random_llama, machine, write_adapters  # noqa: E402

from loragw.engine import LLM, SamplingParams  # noqa: E402
from loragw.engine.distributed import group  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Traffic:
    """Bytes through group.all_reduce / all_gather on this rank (each rank moves the same)."""

    def __init__(self):
        self.reduce = self.gather = 0
        reduce, gather = group.all_reduce, group.all_gather

        def counted_reduce(t):
            self.reduce += t.numel() * t.element_size()
            return reduce(t)

        def counted_gather(t):
            self.gather += t.numel() * t.element_size()
            return gather(t)
        group.all_reduce, group.all_gather = counted_reduce, counted_gather

    def take(self) -> tuple[int, int]:
        taken = self.reduce, self.gather
        self.reduce = self.gather = 0
        return taken


def decode_steps(llm: LLM, batch: int, adapters: list[str], steps: int, traffic: Traffic):
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(10, engine.vocab_size, (32,), generator=g).tolist()
        engine.add_request(prompt, params, adapter=adapters[i % len(adapters)] if adapters else None)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    times, moved = [], []
    for _ in range(steps):
        traffic.take()
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        moved.append(traffic.take())
    for request_id in list(engine.requests):
        engine.abort(request_id)
    engine.drain_aborted()
    return statistics.median(times) * 1e3, moved[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--root", default=tempfile.gettempdir())
    args = ap.parse_args()
    model = build_random_llama(os.path.join(args.root, "loragw-bench-llama"))
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    dirs = write_adapters(os.path.join(args.root, "loragw-bench-tp-adapters"), cfg, TARGETS,
                          args.adapters, seed=3, rank=16)
    traffic = Traffic()
    rows = []
    for tp in (1, 2):
        llm = LLM(model, device="cpu", tensor_parallel_size=tp, max_num_seqs=args.batch,
                  max_loras=args.adapters, max_model_len=256, enable_prefix_caching=False)
        names = []
        for k, path in enumerate(dirs):
            names.append(f"a{k}")
            llm.add_adapter(names[-1], path)
        for adapters in ([], names):
            decode_steps(llm, args.batch, adapters, 3, traffic)  # warm-up
            ms, (reduced, gathered) = decode_steps(llm, args.batch, adapters, args.steps, traffic)
            rows.append((tp, len(adapters), ms, reduced, gathered))
        llm.close()
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    print(f"Machine: {machine()}; model: random Llama, {layers} layers, hidden {hidden}, vocab "
          f"{cfg.vocab_size}, float32; decode steps of {args.batch} rows (median of "
          f"{args.steps})\n")
    print("| TP | adapters | step ms | all-reduce bytes / step | per layer | all-gather bytes "
          "/ step (logits) |")
    print("|---:|---:|---:|---:|---:|---:|")
    embedding = args.batch * hidden * 4  # embed_tokens' one all-reduce a step (float32)
    for tp, n, ms, reduced, gathered in rows:
        per_layer = (reduced - embedding) // layers if reduced else 0  # o_proj + down_proj
        print(f"| {tp} | {n} | {ms:.1f} | {reduced} | {per_layer} | {gathered} |")


if __name__ == "__main__":
    main()
