"""Decode throughput: the engine vs transformers `generate` on one random ~25M Llama (float32,
CPU), all in one run, plus the projection-GEMM roofline timed in the same process.

    python benchmarks/bench_engine.py [--model-dir DIR] [--quick]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer, build_random_llama, machine  # noqa: E402

from loragw.engine import LLM, SamplingParams  # noqa: E402

PROMPT_LEN = 32


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]


def roofline_tokens_per_s(llm: LLM, batch: int, repeats: int = 20) -> float:
    """Tokens/s if a decode step cost only its projection GEMMs (incl. lm_head) at M=batch."""
    model = llm.engine.runner.model
    weights = []
    for layer in model.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj):
            weights.append(linear.dense_weight())
    weights.append(model.lm_head.weight)
    xs = [torch.randn(batch, w.shape[1]) for w in weights]
    with torch.inference_mode():
        for _ in range(3):
            for x, w in zip(xs, weights):
                torch.nn.functional.linear(x, w)
        with Timer() as t:
            for _ in range(repeats):
                for x, w in zip(xs, weights):
                    torch.nn.functional.linear(x, w)
    return batch * repeats / t.seconds


def engine_run(llm: LLM, batch_prompts, lengths) -> tuple[float, int]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    llm.generate(batch_prompts[:2], params[:2])  # warm-up
    with Timer() as t:
        outs = llm.generate(batch_prompts, params)
    tokens = sum(len(o.token_ids) for o in outs)
    return tokens / t.seconds, tokens


def hf_run(model, batch_prompts, max_new: int) -> tuple[float, int]:
    """Static batching: every row runs until the longest finishes."""
    ids = torch.tensor(batch_prompts)
    model.generate(ids[:1], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
    with Timer() as t:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].numel() / t.seconds, out[:, ids.shape[1]:].numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(),
                                                            "loragw-bench-llama25m"))
    parser.add_argument("--quick", action="store_true", help="fewer tokens (smoke run)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from transformers import AutoModelForCausalLM

    path = build_random_llama(args.model_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in hf.parameters())
    llm = LLM(path, device="cpu", dtype="float32", max_num_seqs=64)
    vocab = hf.config.vocab_size
    decode = 32 if args.quick else 128
    rows = []

    roof = roofline_tokens_per_s(llm, 32)
    eng32, _ = engine_run(llm, prompts(32, vocab), [decode] * 32)
    hf32, _ = hf_run(hf, prompts(32, vocab), decode)
    rows.append((f"batch 32, {decode} tokens each", eng32, hf32,
                 f"engine {eng32 / roof:.0%} of roofline {roof:.0f} tok/s; "
                 f"transformers {hf32 / roof:.0%}"))

    eng1, _ = engine_run(llm, prompts(1, vocab), [decode])
    hf1, _ = hf_run(hf, prompts(1, vocab), decode)
    rows.append((f"batch 1, {decode} tokens", eng1, hf1, f"{eng1 / hf1:.2f}x transformers"))

    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(8, 129 if not args.quick else 33, (32,), generator=g).tolist()
    engv, toks = engine_run(llm, prompts(32, vocab, seed=5), lengths)
    # transformers static batching: the batch runs to the longest request; only useful tokens count
    _, padded = hf_run(hf, prompts(32, vocab, seed=5), max(lengths))
    hf_time = padded / _  # seconds
    hfv = toks / hf_time
    rows.append((f"32 requests, 8-{max(lengths)} tokens", engv, hfv,
                 f"{engv / hfv:.2f}x transformers static batching"))

    print(f"\nmachine: {machine()}; model: random Llama, {n_params / 1e6:.1f}M params, float32")
    print("| workload | engine tok/s | transformers tok/s | ratio |")
    print("|---|---:|---:|---|")
    for name, e, h, note in rows:
        print(f"| {name} | {e:.0f} | {h:.0f} | {note} |")


if __name__ == "__main__":
    main()
