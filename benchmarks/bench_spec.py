"""Speculative decoding, side by side: tok/s and TPOT p50 at concurrency 1, 4 and 16, on a
copying workload and on random prompts, with 0 and 16 adapters, speculation off and with
prompt lookup (ngram), and vLLM's CPU build with its ngram method on the same requests.

    python benchmarks/bench_spec.py [--vllm-python V/bin/python] [--tokens 96] [--k 4]
                                    [--trained-draft STEPS] [--json spec.json]

The model: the bench Llama's shape (25M, 8 layers, hidden 512, vocab 8192) with random weights
and its attention output projections scaled by 1/200, so that greedy decoding often falls back
into spans it produced before, as a model copying from its context does; a step costs what the
bench Llama's costs. Adapters: rank 16 on every projection but o_proj. Copying workload: each prompt is 16 random tokens and the 256 tokens the
model (with the request's adapter) then generates greedily; its answer, the next --tokens,
repeats spans of the prompt ("lookup hit" says how often the next token is what prompt lookup
would propose). Random workload: 272 random tokens. Greedy, ignore_eos. Requests join as others
finish (spec_driver.drive); 8 requests at concurrency 1 and 4, 32 at 16.

Modes: off; ngram (k = --k at most, prompt_lookup_min 1, max 3; each request's draft length
chosen per step by the goodput model, engine/spec/goodput.py); "ngram, every draft" (every
lookup drafted in full, the model bypassed), which shows what the model saves; draft (method draft_model: the model's first 2 of 8 layers, its norm and head, as
the draft) and, with adapters, "draft + drafters" (each adapter's layers 0-1 as its draft
LoRA). Random weights give a draft that agrees with its target only by chance, so these draft
rows measure the machinery's cost at the acceptance they get; with --trained-draft STEPS the
draft is first distilled on the target's greedy outputs (STEPS of training) and each adapter's
draft LoRA on that adapter's (STEPS / 8), as benchmarks/train_drafter.py does, so the rows
show what trained drafters gain.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # its neighbours

from common import layer_of, machine, save_random, write_adapters, write_json  # noqa: E402
from spec_driver import drive  # noqa: E402
from train_drafter import distil_draft, distil_drafters  # noqa: E402

from loragw.engine import LLM, SamplingParams  # noqa: E402
from loragw.engine.spec import speculator as speculator_module  # noqa: E402
from loragw.engine.spec.ngram import lookup  # noqa: E402

# o_proj left out: an adapter there would give attention back the weight the model's scaling
# took away, and its output would stop repeating itself
TARGETS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_SCALE = 1 / 200
CONCURRENCY = {1: 8, 4: 8, 16: 32}  # concurrency -> requests


def build_copying_llama(out_dir: str, scale: float = ATTENTION_SCALE) -> str:
    """The bench Llama's shape with its o_proj weights scaled by `scale` (built once)."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    config = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1376,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    save_random(out_dir, 0, lambda: LlamaForCausalLM(config))
    path = os.path.join(out_dir, "model.safetensors")
    tensors = {k: v * scale if "o_proj" in k else v for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    return out_dir


def build_draft(model: str, out_dir: str, layers: int = 2) -> str:
    """The first `layers` decoder layers of `model`, with its embeddings, norm and head."""
    from safetensors.torch import load_file, save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = layers
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    tensors = load_file(os.path.join(model, "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if layer_of(k) < layers},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def draft_adapters(adapters: list[str], out_root: str, layers: int = 2) -> dict[str, str]:
    """{adapter name: its layers < `layers`, saved as a draft LoRA}."""
    from safetensors.torch import load_file, save_file

    out = {}
    for i, path in enumerate(adapters):
        target = os.path.join(out_root, f"draft{i:02d}")
        os.makedirs(target, exist_ok=True)
        tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
        save_file({k: v for k, v in tensors.items() if layer_of(k) < layers},
                  os.path.join(target, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json")) as f, \
                open(os.path.join(target, "adapter_config.json"), "w") as g:
            g.write(f.read())
        out[f"a{i}"] = target
    return out


def workloads(model: str, adapters: list[str], tokens: int) -> dict[str, tuple]:
    """{"copying" | "random": (prompts, adapter index per request, lookup hit rate)}."""
    n = max(CONCURRENCY.values())
    g = torch.Generator().manual_seed(0)
    names = [i % len(adapters) if adapters else None for i in range(n)]
    seeds = [torch.randint(10, 8192, (16,), generator=g).tolist() for _ in range(n)]
    with LLM(model, max_model_len=2048, max_loras=max(len(adapters), 1)) as llm:
        for i, path in enumerate(adapters):
            llm.add_adapter(f"a{i}", path)
        outs = llm.generate(seeds, SamplingParams(max_tokens=256 + tokens, temperature=0.0,
                                                  ignore_eos=True),
                            [f"a{k}" if k is not None else None for k in names])
    copying = [s + o.token_ids[:256] for s, o in zip(seeds, outs)]
    hits = total = 0
    for s, o in zip(seeds, outs):
        history = np.array(s + o.token_ids)
        for i in range(16 + 256, len(history)):
            proposal = lookup(history[:i], 1, 3, 1)
            hits += bool(proposal) and proposal[0] == history[i]
            total += 1
    rand = [torch.randint(10, 8192, (272,), generator=g).tolist() for _ in range(n)]
    return {"copying": (copying, names, hits / total), "random": (rand, names, None)}


def run_ours(model: str, adapters: list[str], loads: dict, tokens: int, k: int,
             results: dict, key_adapters: int, draft: str, drafters: dict[str, str],
             only: list[str] | None) -> None:
    modes = {"off": None,
             "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                       "prompt_lookup_max": 3},
             "ngram, every draft": {"method": "ngram", "num_speculative_tokens": k,
                                    "prompt_lookup_min": 1, "prompt_lookup_max": 3},
             "draft": {"method": "draft_model", "num_speculative_tokens": k, "model": draft}}
    if drafters:
        modes["draft + drafters"] = modes["draft"] | {"draft_adapters": drafters}
    modes = {m: c for m, c in modes.items() if only is None or m in only}
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    ids = itertools.count()
    choose = speculator_module.choose_lengths
    for mode, spec in modes.items():
        speculator_module.choose_lengths = (
            (lambda alphas, caps, rows, costs, forced=None: list(caps))
            if mode == "ngram, every draft" else choose)
        with LLM(model, max_model_len=2048, max_loras=max(len(adapters), 1), max_num_seqs=16,
                 speculative_config=spec) as llm:
            for i, path in enumerate(adapters):
                llm.add_adapter(f"a{i}", path)
            engine = llm.engine
            for workload, (prompts, names, _) in loads.items():
                for conc, n in CONCURRENCY.items():
                    def add(i, prompts=prompts, names=names, engine=engine):
                        adapter = f"a{names[i]}" if names[i] is not None else None
                        return engine.add_request(prompts[i], params, adapter, str(next(ids)))

                    def step(engine=engine):
                        return [(o.request_id, o.num_output_tokens, o.finished)
                                for o in engine.step()]

                    drive(2, 1, add, step)  # warm-up
                    before = _spec_totals(engine)
                    row = drive(n, conc, add, step).row()
                    after = _spec_totals(engine)
                    drafted = after[0] - before[0]
                    row["acceptance"] = (after[1] - before[1]) / drafted if drafted else None
                    results[f"{workload}:{key_adapters}:{conc}:{mode}"] = row
                    print(workload, key_adapters, conc, mode, row, flush=True)


def _spec_totals(engine) -> tuple[int, int]:
    if engine.speculator is None:
        return 0, 0
    counts = engine.speculator.counts.values()
    return sum(c.draft_tokens for c in counts), sum(c.accepted_tokens for c in counts)


def run_vllm(python: str, model: str, adapters: list[str], loads: dict, tokens: int, k: int,
             results: dict, key_adapters: int) -> None:
    runs = [{"key": f"{w}:{key_adapters}:{conc}", "concurrency": conc,
             "prompts": prompts[:n], "adapters": names[:n]}
            for w, (prompts, names, _) in loads.items() for conc, n in CONCURRENCY.items()]
    spec = {"model": model, "adapters": adapters, "runs": runs, "tokens": tokens, "k": k}
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", OMP_NUM_THREADS=str(os.cpu_count()))
    done = subprocess.run([python, str(ROOT / "benchmarks" / "vllm_spec.py")],
                          input=json.dumps(spec), capture_output=True, text=True, env=env)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        print(done.stderr[-3000:], file=sys.stderr)
        results[f"vllm:{key_adapters}"] = {"error": done.stderr[-500:]}
        return
    for key, row in json.loads(line[len("RESULT "):]).items():
        results[f"vllm:{key}"] = row
        print("vllm", key, row, flush=True)


def table(results: dict, hit_rates: dict) -> str:
    lines = ["| workload | adapters | conc | mode | loragw tok/s | TPOT p50 ms | acceptance | "
             "speedup (TPOT vs off) | vLLM tok/s | vLLM TPOT ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key, row in results.items():
        if key.startswith("vllm:"):
            continue
        workload, adapters, conc, mode = key.split(":")
        off = results[f"{workload}:{adapters}:{conc}:off"]
        peer = {"off": "off", "ngram": "ngram"}.get(mode)
        vllm = results.get(f"vllm:{workload}:{adapters}:{conc}:{peer}", {}) if peer else {}
        acc = "-" if row.get("acceptance") is None else f"{row['acceptance']:.2f}"
        vtok = f"{vllm['tok_s']:.0f}" if "tok_s" in vllm else vllm.get("error", "-")[:60]
        vtpot = f"{vllm['tpot_ms']:.1f}" if "tpot_ms" in vllm else "-"
        lines.append(f"| {workload} | {adapters} | {conc} | {mode} | {row['tok_s']:.0f} | "
                     f"{row['tpot_ms']:.1f} | {acc} | {off['tpot_ms'] / row['tpot_ms']:.2f}x | "
                     f"{vtok} | {vtpot} |")
    hits = ", ".join(f"{a} adapters {r:.2f}" for a, r in hit_rates.items())
    return "\n".join(lines) + f"\n\nCopying workload, prompt-lookup hit rate of the answers: {hits}."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-python", help="python of a venv with vLLM's CPU build")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--adapters", type=int, nargs="*", default=[0, 16])
    ap.add_argument("--attention-scale", type=float, default=ATTENTION_SCALE,
                    help="o_proj scale: lower copies more (0.002: answers repeat the prompt "
                         "verbatim)")
    ap.add_argument("--modes", nargs="*", help="only these of ours (default: all)")
    ap.add_argument("--trained-draft", type=int, metavar="STEPS",
                    help="distil the draft (STEPS of training) and each adapter's draft LoRA "
                         "on the target's outputs first (benchmarks/train_drafter.py)")
    ap.add_argument("--json")
    args = ap.parse_args()
    root = tempfile.gettempdir()
    model = build_copying_llama(os.path.join(root, f"loragw-bench-llama25m-copying-"
                                                   f"{args.attention_scale:g}"),
                                args.attention_scale)
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model)
    draft = build_draft(model, model + "-draft2")
    if args.trained_draft:
        print("trained draft:", distil_draft(model, draft, model + "-draft2-trained",
                                             args.trained_draft), flush=True)
        draft = model + "-draft2-trained"
    print(f"machine: {machine()}; o_proj scale {args.attention_scale:g}")
    results, hit_rates = {}, {}
    for count in args.adapters:
        adapters = write_adapters(os.path.join(root, "loragw-bench-spec-adapters"), hf_config,
                                  TARGETS, count, seed=3) if count else []
        loads = workloads(model, adapters, args.tokens)
        hit_rates[count] = loads["copying"][2]
        if not args.trained_draft:
            drafters = draft_adapters(adapters, os.path.join(root, "loragw-bench-spec-drafters"))
        elif adapters:
            drafters, records = distil_drafters(model, draft, adapters,
                                                model + "-drafters-trained", args.trained_draft // 8)
            print("trained drafters:", records, flush=True)
        else:
            drafters = {}
        run_ours(model, adapters, loads, args.tokens, args.k, results, count, draft, drafters,
                 args.modes)
        if args.vllm_python:
            run_vllm(args.vllm_python, model, adapters, loads, args.tokens, args.k, results,
                     count)
    print(table(results, hit_rates))
    write_json(args.json, {"machine": machine(), "results": results, "hit_rates": hit_rates})


if __name__ == "__main__":
    main()
