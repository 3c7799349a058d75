"""Quantized bases on the CPU: resident weight bytes and decode throughput of the bench Llama
(random ~25M with the demo tokenizer, float32) served fp32, bf16, int8 (W8A16 per channel), int4 (W4A16, groups of 32:
the model's intermediate 1376 has no groups of 128) and FP8 (FP8_DYNAMIC per channel, weights
only here), each checkpoint written by llm-compressor; decode tok/s at batch 1, 8 and 32 with
no adapter and with distinct rank-16 all-linear adapters (min(batch, 32) of 32 registered),
side by side in one run; batch 1 as a fraction of the bandwidth bound (resident weight bytes
read once per step at the measured copy bandwidth); vLLM's CPU build on the same checkpoints
where it serves them (its failure named where it does not). Last, one projection (the model's
gate_up, 2752 x 512) each way the CPU can multiply by a quantized weight: dequantize-then-GEMM,
the C kernel (kernels/cpu_quant.py, the engine's path) and torch's own weight-only kernels
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`), with the fp32 GEMM beside them, and the
C kernel's weight bytes per second at batch 1 against the copy bandwidth (`--kernels`: that
table alone).

    python benchmarks/bench_quant.py [--quick] [--kernels] [--vllm-python V/bin/python]
        [--quant-python .venv-quant/bin/python] [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer, build_llama25m_with_tokenizer, machine, write_adapters  # noqa: E402

from loragw.engine import LLM, SamplingParams  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BATCHES = (1, 8, 32)
ADAPTERS = 32
PROMPT_LEN = 16
# name -> (llm-compressor scheme and group size, or None for the float checkpoint; dtype)
VARIANTS = {"fp32": (None, "float32"), "bf16": (None, "bfloat16"),
                 "int8": (("W8A16", 0), "float32"), "int4": (("W4A16", 32), "float32"),
                 "fp8": (("FP8_DYNAMIC", None), "float32")}


@dataclass
class Row:
    variant: str
    weight_bytes: int = 0
    tok_s: dict[tuple[int, bool], float] = field(default_factory=dict)  # (batch, adapters)
    vllm: dict[tuple[int, bool], float] = field(default_factory=dict)
    vllm_error: str | None = None


def copy_bandwidth(megabytes: int = 512) -> float:
    """Bytes/s of one large tensor copy (read + write), the best of five."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        with Timer() as t:
            dst.copy_(src)
        best = min(best, t.seconds)
    return 2 * src.numel() * 4 / best


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]


def decode_tok_s(llm: LLM, batch: int, adapters: list[str] | None, tokens: int,
                 vocab: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    names = [adapters[i % len(adapters)] for i in range(batch)] if adapters else None
    llm.generate(prompts(batch, vocab, 1), params, adapters=names)  # warm-up: slots loaded
    with Timer() as t:
        outs = llm.generate(prompts(batch, vocab), params, adapters=names)
    return sum(len(o.token_ids) for o in outs) / t.seconds


def checkpoint(variant: str, base: str, root: str, quant_python: str) -> str:
    scheme = VARIANTS[variant][0]
    if scheme is None:
        return base
    name, group = scheme
    out = os.path.join(root, f"bench-{variant}")
    cmd = [quant_python, os.path.join(HERE, "quantize.py"), base, out, name]
    if group is not None:
        cmd += ["--group-size", str(group)]
    subprocess.run(cmd, check=True, capture_output=True)
    return out


def measure_ours(row: Row, path: str, dtype: str, adapters: dict[str, str], tokens: int,
                 vocab: int) -> None:
    with LLM(path, device="cpu", dtype=dtype, max_loras=ADAPTERS, max_num_seqs=32,
             max_lora_rank=16, num_kv_blocks=512) as llm:
        row.weight_bytes = llm.engine.runner.model.weight_bytes()
        for name, adapter in adapters.items():
            llm.add_adapter(name, adapter)
        for batch in BATCHES:
            for with_adapters in (False, True):
                row.tok_s[batch, with_adapters] = decode_tok_s(
                    llm, batch, list(adapters) if with_adapters else None, tokens, vocab)


def measure_vllm(row: Row, python: str, path: str, dtype: str, adapters: dict[str, str],
                 tokens: int, vocab: int) -> None:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", OMP_NUM_THREADS=str(os.cpu_count()))
    spec = json.dumps({"model": path, "dtype": dtype, "adapters": adapters, "tokens": tokens,
                       "batches": BATCHES, "prompt_len": PROMPT_LEN,
                       "vocab": vocab})
    done = subprocess.run([python, os.path.join(HERE, "vllm_decode.py"), spec], env=env,
                          capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        error = [line for line in done.stderr.splitlines() if "Error" in line]
        row.vllm_error = (error[-1] if error else f"exit {done.returncode}")[:200]
        return
    for key, value in json.loads(lines[-1]).items():
        batch, with_adapters = key.split(":")
        row.vllm[int(batch), with_adapters == "1"] = value


def best_us(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(5):
        with Timer() as t:
            for _ in range(repeats):
                fn()
        best = min(best, t.seconds / repeats * 1e6)
    return best


def kernel_table(bandwidth: float, rows: int = 2752, columns: int = 512, group: int = 32) -> str:
    """Microseconds of one projection per way of multiplying by a quantized weight; at batch 1,
    the weight bytes the fp32 GEMM and the C kernel read per second, against the copy
    bandwidth."""
    import torch.nn.functional as F

    from loragw.kernels import cpu_quant
    from loragw.kernels.quant import dequant_linear, unpack_int4

    g = torch.Generator().manual_seed(0)
    w4 = cpu_quant.random_weight("int4", rows, columns, group, True, False, g)
    w8 = cpu_quant.random_weight("int8", rows, columns, columns, False, False, g)
    fp8 = cpu_quant.random_weight("fp8", rows, columns, columns, False, False, g)
    packed4 = torch._convert_weight_to_int4pack_for_cpu(
        unpack_int4(w4.qweight, columns).int() + 8, 1)
    scales_zeros = torch.stack([w4.scales.T, (-w4.zeros.float() * w4.scales).T], -1).contiguous()
    dense = torch.randn(rows, columns, generator=g)
    # (header, weight bytes read or None, the call)
    ways = [("fp32 GEMM", dense.numel() * 4, lambda x: F.linear(x, dense))]
    for name, w in (("int4 g32", w4), ("int8 channel", w8), ("fp8 channel", fp8)):
        ways += [(f"{name}: dequantize + GEMM", None, lambda x, w=w: dequant_linear(x, w)),
                 (f"{name}: C kernel", w.num_bytes, lambda x, w=w: cpu_quant.quant_linear(x, w))]
    ways += [("int4: `_weight_int4pack_mm_for_cpu`", None,
              lambda x: torch._weight_int4pack_mm_for_cpu(x, packed4, group, scales_zeros)),
             ("int8: `_weight_int8pack_mm`", None,
              lambda x: torch._weight_int8pack_mm(x, w8.qweight, w8.scales[:, 0]))]
    lines = [f"One projection, {rows} x {columns}, microseconds (best of 5):", "",
             "| tokens | " + " | ".join(head for head, _, _ in ways) + " |",
             "|---:|" + "---:|" * len(ways)]
    rates = []
    for tokens in (1, 8, 32, 256):
        x = torch.randn(tokens, columns, generator=g)
        cells = [best_us(lambda call=call, x=x: call(x)) for _, _, call in ways]
        lines.append(f"| {tokens} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
        if tokens == 1:
            rates = [f"{head.removesuffix(': C kernel')} {size / us / 1e3:.1f}"
                     for (head, size, _), us in zip(ways, cells) if size]
    lines += ["", f"Batch 1, weight bytes read per second (codes, scales and zero points; the "
              f"C kernel but for the fp32 GEMM), GB/s: {', '.join(rates)}; copy bandwidth "
              f"{bandwidth / 1e9:.1f} GB/s (bytes read + written)"]
    return "\n".join(lines)


def table(rows: list[Row], bandwidth: float, tokens: int) -> str:
    fp32 = rows[0]
    head = " | ".join(f"b{b}{' +LoRA' if a else ''}" for b in BATCHES for a in (False, True))
    lines = [f"| base | weight MiB | vs fp32 | {head} | b1 / bandwidth bound |",
             "|---|---:|---:|" + "---:|" * (2 * len(BATCHES)) + "---:|"]
    for row in rows:
        bound = bandwidth / row.weight_bytes
        cells = " | ".join(f"{row.tok_s[b, a]:.0f}" for b in BATCHES for a in (False, True))
        lines.append(f"| {row.variant} | {row.weight_bytes / 2**20:.1f} | "
                     f"{row.weight_bytes / fp32.weight_bytes:.2f} | {cells} | "
                     f"{row.tok_s[1, False] / bound:.0%} of {bound:.0f} tok/s |")
    if any(row.vllm or row.vllm_error for row in rows):
        lines += ["", f"vLLM CPU build, same checkpoints, same workloads ({tokens} tokens):", "",
                  f"| base | {head} | engine / vLLM at b32 |",
                  "|---|" + "---:|" * (2 * len(BATCHES)) + "---|"]
        for row in rows:
            if row.vllm_error:
                lines.append(f"| {row.variant} | does not serve it: {row.vllm_error} |")
                continue
            cells = " | ".join(f"{row.vllm.get((b, a), 0):.0f}" for b in BATCHES
                               for a in (False, True))
            ratio = row.tok_s[32, False] / row.vllm[32, False] if row.vllm.get(
                (32, False)) else float("nan")
            lines.append(f"| {row.variant} | {cells} | {ratio:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer tokens (smoke run)")
    parser.add_argument("--vllm-python", help="python of a venv with vLLM's CPU build")
    parser.add_argument("--quant-python", default=os.path.join(
        os.path.dirname(HERE), ".venv-quant", "bin", "python"))
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "loragw-bench-quant"))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--kernels", action="store_true", help="the one-projection table alone")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.kernels:
        print(f"machine: {machine()}\n\n{kernel_table(copy_bandwidth())}")
        return
    from transformers import AutoConfig

    os.makedirs(args.root, exist_ok=True)
    base = build_llama25m_with_tokenizer(args.root)  # vLLM needs a tokenizer
    hf_config = AutoConfig.from_pretrained(base)
    adapters = {f"a{i:02d}": path for i, path in enumerate(
        write_adapters(os.path.join(args.root, "adapters"), hf_config, TARGETS, ADAPTERS, 0))}
    tokens = 16 if args.quick else 64
    bandwidth = copy_bandwidth()
    rows = []
    for variant in args.variants.split(","):
        row = Row(variant)
        path = checkpoint(variant, base, args.root, args.quant_python)
        dtype = VARIANTS[variant][1]
        measure_ours(row, path, dtype, adapters, tokens, hf_config.vocab_size)
        if args.vllm_python:
            measure_vllm(row, args.vllm_python, path, dtype, adapters, tokens,
                         hf_config.vocab_size)
        rows.append(row)
        logging.warning("%s: ours %s; vLLM %s", variant, row.tok_s, row.vllm_error or row.vllm)
    print(f"\nmachine: {machine()}; copy bandwidth {bandwidth / 1e9:.1f} GB/s; {tokens} decode "
          f"tokens per request after a {PROMPT_LEN}-token prompt; tok/s\n")
    print(table(rows, bandwidth, tokens))
    print()
    print(kernel_table(bandwidth))


if __name__ == "__main__":
    main()
