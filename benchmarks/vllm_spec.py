"""vLLM's side of bench_spec.py: the same requests through vLLM's CPU build, offline, speculation
off and with its ngram method, driven by spec_driver.drive. Runs in vLLM's venv; prints one JSON
line {"WORKLOAD:ADAPTERS:CONCURRENCY:MODE": {"tok_s": .., "tpot_ms": ..}} (or {"error": ..}).

    V/bin/python benchmarks/vllm_spec.py < spec.json   ({"model": DIR, "adapters": [...], ...})
"""

from __future__ import annotations

import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spec_driver import drive  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402


def run_mode(spec: dict, mode: str, out: dict) -> None:
    extra = {}
    if mode == "ngram":
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": spec["k"],
                                       "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    adapters = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(spec["adapters"])]
    try:
        llm = LLM(spec["model"], dtype="float32", enable_lora=bool(adapters),
                  max_loras=max(len(adapters), 1), max_lora_rank=16,
                  max_num_seqs=max(r["concurrency"] for r in spec["runs"]), max_model_len=2048,
                  skip_tokenizer_init=True, **extra)  # token ids in and out
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        for r in spec["runs"]:
            out[f"{r['key']}:{mode}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        return
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=spec["tokens"], temperature=0.0, ignore_eos=True,
                            detokenize=False)
    ids = itertools.count()
    for r in spec["runs"]:
        prompts, names = r["prompts"], r["adapters"]

        def add(i, prompts=prompts, names=names):
            request_id = str(next(ids))
            lora = adapters[names[i]] if names[i] is not None else None
            engine.add_request(request_id, {"prompt_token_ids": prompts[i]}, params,
                               lora_request=lora)
            return request_id

        def step():
            return [(o.request_id, len(o.outputs[0].token_ids), o.finished)
                    for o in engine.step()]

        drive(min(2, len(prompts)), 1, add, step)  # warm-up
        out[f"{r['key']}:{mode}"] = drive(len(prompts), r["concurrency"], add, step).row()
    del llm


def main() -> None:
    spec = json.loads(sys.stdin.read())
    out: dict = {}
    for mode in ("off", "ngram"):
        run_mode(spec, mode, out)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
