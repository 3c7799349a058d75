"""Does speculation ever cost speed? Speculation off against ngram (each request's draft length
chosen per step by the goodput model, engine/spec/goodput.py, 0 included), both engines loaded
at once and run in alternation (ABBA), so this machine's drift falls on both alike.

    python benchmarks/bench_spec_rule.py [--rounds 6] [--adapters 0 16] [--tokens 96]
                                         [--concurrency 1 4 16]

Same model, adapters and workloads as bench_spec.py (copying and random; 8 requests at
concurrency 1 and 4, 32 at 16, a new one joining as one finishes). Per round, each mode's tok/s
and TPOT p50 and the ratio ngram / off; the table gives the median, min and max of the ratios
and how many rows a run verified drafts in.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # its neighbours

from bench_spec import TARGETS, build_copying_llama, workloads  # noqa: E402
from common import machine, write_adapters, write_json  # noqa: E402
from spec_driver import drive  # noqa: E402

from loragw.engine import LLM, SamplingParams  # noqa: E402

REQUESTS = {1: 8, 4: 8, 16: 32}  # concurrency -> requests a run


def engines(model: str, adapters: list[str], k: int) -> dict[str, LLM]:
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3}
    out = {}
    for mode, spec in (("off", None), ("ngram", ngram)):
        llm = LLM(model, max_model_len=2048, max_loras=max(len(adapters), 1),
                  max_num_seqs=16, speculative_config=spec)
        for i, path in enumerate(adapters):
            llm.add_adapter(f"a{i}", path)
        out[mode] = llm
    return out


def run(llm: LLM, prompts, names, params, ids, n: int, concurrency: int) -> tuple[dict, int]:
    """One drive of `n` requests at `concurrency`; (its row, verification rows it ran)."""
    engine = llm.engine

    def add(i):
        adapter = f"a{names[i]}" if names[i] is not None else None
        return engine.add_request(prompts[i], params, adapter, str(next(ids)))

    def step():
        return [(o.request_id, o.num_output_tokens, o.finished) for o in engine.step()]

    before = drafts(engine)
    row = drive(n, concurrency, add, step).row()
    return row, drafts(engine) - before


def drafts(engine) -> int:
    spec = engine.speculator
    return 0 if spec is None else sum(c.drafts for c in spec.counts.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--adapters", type=int, nargs="*", default=[0, 16])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--json")
    args = ap.parse_args()
    root = tempfile.gettempdir()
    model = build_copying_llama(os.path.join(root, "loragw-bench-llama25m-copying-0.005"))
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model)
    print(f"machine: {machine()}; {args.rounds} rounds, ABBA")
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    ids, results, lines = itertools.count(), {}, []
    for count in args.adapters:
        adapters = write_adapters(os.path.join(root, "loragw-bench-spec-adapters"), hf_config,
                                  TARGETS, count, seed=3) if count else []
        loads = workloads(model, adapters, args.tokens)
        llms = engines(model, adapters, args.k)
        for (workload, (prompts, names, _)), conc in itertools.product(loads.items(),
                                                                       args.concurrency):
            for llm in llms.values():
                run(llm, prompts, names, params, ids, 4, conc)  # warm-up
            rows = {"off": [], "ngram": []}
            drafted = 0
            for r in range(args.rounds):
                for mode in (("off", "ngram") if r % 2 == 0 else ("ngram", "off")):
                    row, n = run(llms[mode], prompts, names, params, ids, REQUESTS[conc], conc)
                    rows[mode].append(row)
                    drafted += n
                    print(workload, count, conc, r, mode, row, n, flush=True)
            tok = [b["tok_s"] / a["tok_s"] for a, b in zip(rows["off"], rows["ngram"])]
            tpot = [a["tpot_ms"] / b["tpot_ms"] for a, b in zip(rows["off"], rows["ngram"])]
            results[f"{workload}:{count}:{conc}"] = {"rows": rows, "tok_ratio": tok,
                                                     "tpot_ratio": tpot,
                                                     "verification_rows": drafted}
            med = {m: statistics.median(x["tok_s"] for x in v) for m, v in rows.items()}
            lines.append(
                f"| {workload} | {count} | {conc} | {med['off']:.0f} / {med['ngram']:.0f} | "
                f"{statistics.median(tok):.2f}x ({min(tok):.2f}-{max(tok):.2f}) | "
                f"{statistics.median(tpot):.2f}x ({min(tpot):.2f}-{max(tpot):.2f}) | "
                f"{drafted / args.rounds:.1f} |")
        for llm in llms.values():
            llm.close()
    print("| workload | adapters | concurrency | tok/s off / ngram (median) | ngram / off tok/s: "
          "median (min-max) | TPOT off / ngram: median (min-max) | verification rows a run |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(lines))
    write_json(args.json, {"machine": machine(), "results": results})


if __name__ == "__main__":
    main()
