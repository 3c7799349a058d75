"""Multi-LoRA decode throughput on the CPU: the engine with no adapter, the engine with every
request on its own rank-16 adapter, and transformers + PEFT mixed-batch generate on the same
requests, all in one run on one random ~25M Llama (float32).

    python benchmarks/bench_lora_cpu.py [--repeats 3] [--threads N] [--write RESULTS.md]

Workload: 32 concurrent requests, 32-token prompts, 64-128 output tokens each (drawn once,
seeded), greedy, ignore_eos. Engine rows: continuous batching, max_loras=32 (every adapter
resident after a warm-up run that loads the slots). PEFT rows: one static batch with
`adapter_names=[...]`, run until the longest request is done; only the requested tokens count
(what a user gets) and the raw rate is noted beside it; plain transformers `generate` the same
way for scale. Each round runs every configuration once and the best of each is kept (the
machine is shared; the load average is reported).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from functools import partial

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer, build_random_llama, machine, write_adapters  # noqa: E402

from loragw.engine import LLM, SamplingParams  # noqa: E402

logger = logging.getLogger("bench_lora_cpu")

NUM_REQUESTS = 32
PROMPT_LEN = 32
RANK = 16
TARGETS = {
    "q,v": ("q_proj", "v_proj"),  # PEFT's default for Llama
    "all seven": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


def workload(vocab: int) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (PROMPT_LEN,), generator=g).tolist()
               for _ in range(NUM_REQUESTS)]
    lengths = torch.randint(64, 129, (NUM_REQUESTS,), generator=g).tolist()
    return prompts, lengths


def engine_tok_s(llm: LLM, prompts, lengths, adapters) -> tuple[float, float]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    with Timer() as t:
        outs = llm.generate(prompts, params, adapters=adapters)
    rate = sum(len(o.token_ids) for o in outs) / t.seconds
    return rate, rate


def hf_tok_s(model, prompts, lengths, adapter_names=None) -> tuple[float, float]:
    """(useful tok/s, raw tok/s) of one static batch run to the longest request; with
    `adapter_names`, PEFT's mixed-adapter batch."""
    ids = torch.tensor(prompts)
    longest = max(lengths)
    extra = {} if adapter_names is None else {"adapter_names": adapter_names}
    with torch.inference_mode(), Timer() as t:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                             pad_token_id=0, **extra)
    assert out.shape[1] == PROMPT_LEN + longest
    return sum(lengths) / t.seconds, len(prompts) * longest / t.seconds


def load_peft(path: str, adapter_dirs: list[str]):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(hf, adapter_dirs[0], adapter_name="a00")
    for k, d in enumerate(adapter_dirs[1:], start=1):
        model.load_adapter(d, adapter_name=f"a{k:02d}")
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "loragw-bench-lora"))
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each config's best is kept")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--write", metavar="PATH", help="also write the markdown table here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("engine").setLevel(logging.WARNING)
    from transformers import AutoConfig, AutoModelForCausalLM

    path = build_random_llama(os.path.join(args.work_dir, "llama25m"))
    hf_config = AutoConfig.from_pretrained(path)
    adapter_dirs = {name: write_adapters(os.path.join(args.work_dir, name.replace(" ", "_")
                                                      .replace(",", "")), hf_config, targets,
                                         NUM_REQUESTS, seed=i)
                    for i, (name, targets) in enumerate(TARGETS.items())}
    prompts, lengths = workload(hf_config.vocab_size)
    names = [f"a{k:02d}" for k in range(NUM_REQUESTS)]

    # Every configuration: name -> a run returning (useful tok/s, raw tok/s).
    runs, engines = {}, []
    for name, dirs in adapter_dirs.items():  # one engine per adapter set: no slot swaps
        llm = LLM(path, device="cpu", dtype="float32", max_num_seqs=64, max_loras=NUM_REQUESTS,
                  max_lora_rank=RANK, lora_backend="torch")
        for k, d in enumerate(dirs):
            llm.add_adapter(names[k], d)
        engines.append(llm)
        if not runs:
            runs["(a) engine, no adapter"] = partial(engine_tok_s, llm, prompts, lengths,
                                                     [None] * NUM_REQUESTS)
        runs[f"(b) engine, 32 distinct adapters, {name}"] = partial(engine_tok_s, llm, prompts,
                                                                    lengths, names)
    for name, dirs in adapter_dirs.items():
        runs[f"(c) transformers + PEFT `adapter_names=`, {name}"] = partial(
            hf_tok_s, load_peft(path, dirs), prompts, lengths, names)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runs["(d) transformers generate, no adapter"] = partial(hf_tok_s, hf, prompts, lengths)

    for llm in engines:  # warm-up: fills the slots, first-touch allocations
        engine_tok_s(llm, prompts, [2] * NUM_REQUESTS, names)
    loads_before = sum(llm.engine.lora.stats.device_loads for llm in engines)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    load_avg = []
    for _ in tqdm(range(args.repeats), desc="rounds (every config once)"):
        load_avg.append(os.getloadavg()[0])
        for name, run in runs.items():
            results[name].append(run())
            logger.info("%s: %.0f tok/s (raw %.0f)", name, *results[name][-1])
    best = {name: max(values) for name, values in results.items()}
    loads = sum(llm.engine.lora.stats.device_loads for llm in engines) - loads_before

    base = best["(a) engine, no adapter"][0]
    lines = [f"machine: {machine()}; 1-minute load average at the start of each round: "
             f"{', '.join(f'{x:.1f}' for x in load_avg)} (other jobs share the 2 cores)",
             f"model: random Llama {hf_config.hidden_size}h x {hf_config.num_hidden_layers} layers "
             f"(~25M params), float32; {NUM_REQUESTS} requests x {PROMPT_LEN}-token prompts, "
             f"{min(lengths)}-{max(lengths)} output tokens ({sum(lengths)} in all), greedy; "
             f"adapters rank {RANK}, max_loras={NUM_REQUESTS}; best of {args.repeats} "
             "interleaved rounds",
             "command: python benchmarks/bench_lora_cpu.py " + " ".join(sys.argv[1:]),
             "",
             "| configuration | best tok/s | vs (a) engine, no adapter | (b) vs this | every run |",
             "|---|---:|---:|---:|---|"]
    for name, (useful, raw) in best.items():
        row = f"| {name} | {useful:.0f}"
        row += f" (raw {raw:.0f})" if name[1] in "cd" else ""
        row += f" | {useful / base:.2f}x | "
        if name[1] == "c":
            targets = name.rsplit(", ", 1)[1]
            row += f"{best[f'(b) engine, 32 distinct adapters, {targets}'][0] / useful:.1f}x"
        row += " | " + ", ".join(f"{u:.0f}" for u, _ in results[name])
        lines.append(row + " |")
    lines += ["", f"Engine: continuous batching; slot loads during the timed runs: {loads} (all "
              "adapters resident). transformers/PEFT: one static batch run to the longest "
              "request; tok/s counts the requested tokens, raw counts every generated one."]
    table = "\n".join(lines)
    print(table)
    if args.write:
        with open(args.write, "w") as f:
            f.write("# LoRA on the CPU: decode throughput\n\n" + table + "\n")


if __name__ == "__main__":
    main()
