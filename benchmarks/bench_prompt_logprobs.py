"""What prompt logprobs cost: prompt tokens/s of a 1k-token echo request (max_tokens 1) with and
without `logprobs: 1` (engine: prompt_logprobs=1), and the peak extra memory, on the 25M model.

    python benchmarks/bench_prompt_logprobs.py [--tokens 1024] [--repeats 5] [--chunk 2048]

Each mode runs in a fresh subprocess (so its peak RSS is its own), prefix caching off (every
repeat prefills the whole prompt), median of `--repeats` after one warm-up. The theoretical
extra memory is the chunk's logit rows ([chunk, vocab] float32) plus one log_softmax slice.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # its neighbours

from common import build_llama25m_with_tokenizer, machine  # noqa: E402

RUN = r"""
import json, resource, statistics, sys, time
from loragw.engine import LLM, SamplingParams
model, tokens, repeats, chunk, want = json.loads(sys.argv[1])
llm = LLM(model, device="cpu", dtype="float32", enable_prefix_caching=False, max_num_seqs=4,
          max_num_batched_tokens=chunk, max_model_len=tokens + 8)
prompt = [(7 * i) % 2000 + 10 for i in range(tokens)]
params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1 if want else None)
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
times = []
for i in range(repeats + 1):
    t0 = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    if i:
        times.append(time.perf_counter() - t0)
    if want:
        assert len(out.logprobs) == 0 and out.token_ids
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"tok_s": tokens / statistics.median(times),
                  "peak_extra_mb": (rss1 - rss0) / 1024, "rss_mb": rss1 / 1024}))
"""


def run(model: str, tokens: int, repeats: int, chunk: int, want: bool) -> dict:
    out = subprocess.run([sys.executable, "-P", "-c", RUN, json.dumps([model, tokens, repeats, chunk,
                                                                 want])],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=2048, help="--max-num-batched-tokens")
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "bench-serving"))
    args = parser.parse_args()
    model = build_llama25m_with_tokenizer(args.work_dir)
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rows = {want: run(model, args.tokens, args.repeats, args.chunk, want)
            for want in (False, True)}
    print(f"`python benchmarks/bench_prompt_logprobs.py {' '.join(sys.argv[1:])}`; {machine()}; "
          f"{args.tokens}-token prompt, max_tokens 1, chunk {args.chunk}, vocab {vocab}\n")
    print("| | prompt tok/s | peak RSS growth while running |")
    print("|---|---:|---:|")
    for want, name in ((False, "echo, no logprobs"), (True, "echo + logprobs: 1")):
        r = rows[want]
        print(f"| {name} | {r['tok_s']:.0f} | {r['peak_extra_mb']:.1f} MB |")
    rows_in_chunk = min(args.tokens, args.chunk)
    bound = (rows_in_chunk + min(256, rows_in_chunk)) * vocab * 4 / 2**20
    print(f"\ncost: {rows[False]['tok_s'] / rows[True]['tok_s']:.2f}x the time; theoretical "
          f"extra memory {bound:.1f} MB ({rows_in_chunk} logit rows + a 256-row log_softmax "
          f"slice of {vocab} float32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
