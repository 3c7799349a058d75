"""The decode step against what this machine can do: its GEMM peak and copy bandwidth, measured
here, the step's FLOPs and bytes, the step as a fraction of that roofline, where the step's
time goes by op class, and vLLM's CPU build on the same model in the same run.

    python benchmarks/bench_roofline.py [--tokens 128] [--vllm-python /tmp/vv/bin/python]

Machine limits (torch's own threads, all cores):
    GEMM peak   the best of F.linear (MKL) and oneDNN's packed GEMM on a 2048^3 product,
                float32, and bfloat16 when the CPU has it (oneDNN)
    bandwidth   a 256 MiB copy, bytes read + written per second

The model is the random bench Llama (hidden 512, 8 layers, the demo tokenizer's vocabulary), 32
requests of 32-token prompts decoding --tokens greedy tokens each, with no adapter and with 32
distinct rank-16 adapters on all seven projections (request i on adapter i). Rows (CONFIGS):
the float32 step with torch's paths throughout (F.linear, the torch attention, embedding-bag
LoRA, torch's norms and rotary), the default as it was before the C norm and rotary kernels,
the float32 default now (oneDNN, the C decode attention, LoRA, norm and rotary kernels), and
where the CPU has bf16 units (AMX-BF16 or AVX-512 BF16: what --dtype auto serves there)
bfloat16 on torch's paths and on the C kernels' bf16 paths. A decode step's roofline time is max(FLOPs / peak, bytes /
bandwidth): FLOPs = 2 x batch x (projection + lm_head parameters, and each row's adapter's),
bytes = the weights once (and each distinct adapter once) and every row's K and V in every
layer at the run's mean decode context (prompt + half the new tokens). The profile times one batch-32 run
by op class with hooks: projections (the base GEMMs), LoRA (the deltas), attention, lm_head,
norms/rotary/activations (the rest of the forward), sampling, and the host (the step's time
outside the forward and the sampler).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import build_llama25m_with_tokenizer, machine, timed, write_adapters  # noqa: E402

from loragw.engine import LLM, SamplingParams  # noqa: E402
from loragw.engine.config import cpu_auto_dtype  # noqa: E402
from loragw.engine.layers.attention import PagedAttention  # noqa: E402
from loragw.engine.layers.embedding import LMHead  # noqa: E402
from loragw.engine.layers.linear import Linear, LoRABuffers  # noqa: E402
from loragw.kernels import cpu_linear, cpu_lora  # noqa: E402
from loragw.kernels.native import cpu_flags  # noqa: E402

BATCH, PROMPT_LEN, ADAPTERS, RANK = 32, 32, 32, 16
# (row, LLM options, the C LoRA kernel on): the CPU step as it was before each change, and now
CONFIGS = [
    ("float32: F.linear, torch attention, embedding bags, torch norms and rotary", dict(
        linear_backend="torch", attention_backend="torch", elementwise_backend="torch"), False),
    ("float32: oneDNN, C attention, C LoRA, torch norms and rotary", dict(
        elementwise_backend="torch"), True),
    ("float32: oneDNN, C attention, C LoRA, C norms and rotary (the default)", dict(), True),
    ("bfloat16: oneDNN, torch attention, embedding bags, torch norms and rotary", dict(
        dtype="bfloat16", attention_backend="torch", elementwise_backend="torch"), False),
    ("bfloat16: oneDNN, C attention, C LoRA, C norms and rotary (auto's dtype there)", dict(
        dtype="bfloat16"), True),
]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def best_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def gemm_peak(dtype: torch.dtype) -> tuple[float, str]:
    """(FLOP/s, by which GEMM) of a 2048^3 product."""
    n = 2048
    x, w = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    flops = 2 * n**3
    best = {}
    if dtype == torch.float32:
        best["F.linear (MKL)"] = flops / best_seconds(lambda: F.linear(x, w))
    if cpu_linear.supported(torch.device("cpu"), dtype):
        packed = cpu_linear.pack(w, n)
        best["oneDNN packed"] = flops / best_seconds(lambda: cpu_linear.packed_linear(x, packed))
    name = max(best, key=best.get)
    return best[name], name


def copy_bandwidth() -> float:
    src = torch.ones(64 * 2**20)  # 256 MiB of float32
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best_seconds(lambda: dst.copy_(src))


def has_bf16() -> bool:
    """Whether this CPU has bf16 units (the engine's `--dtype auto` rule)."""
    return cpu_auto_dtype(cpu_flags())[0] == torch.bfloat16


def decode_cost(llm: LLM, batch: int, adapters: int, context: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step of `batch` rows of `context` cached tokens on average,
    `adapters` distinct ones among them: the weights (and each distinct adapter) read once, and
    every row's K and V in every layer."""
    runner = llm.engine.runner
    model = runner.model
    dense = sum(m.out_features * m.in_features for m in model.modules() if isinstance(m, Linear))
    head = model.lm_head.local_vocab * model.lm_head.hidden_size
    lora = sum(RANK * (m.in_features + m.out_features) for m in model.modules()
               if isinstance(m, Linear) and m.lora is not None)
    size = torch.finfo(runner.dtype).bits // 8
    flops = 2 * batch * (dense + head + (lora if adapters else 0))
    kv = batch * context * runner.bytes_per_block // runner.block_size
    moved = (dense + head) * size + adapters * lora * size + kv
    return flops, moved


def engine_tok_s(llm: LLM, names: list[str], tokens: int, vocab: int) -> tuple[float, float]:
    """(tok/s of the whole run, median decode step seconds)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (PROMPT_LEN,), generator=g).tolist()
               for _ in range(BATCH)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    adapters = [names[i % len(names)] for i in range(BATCH)] if names else None
    llm.generate(prompts[:4], SamplingParams(max_tokens=4), adapters=adapters and adapters[:4])
    steps: list[float] = []
    engine = llm.engine
    inner = engine.step

    def timed_step():
        start = time.perf_counter()
        out = inner()
        steps.append(time.perf_counter() - start)
        return out

    engine.step = timed_step
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, adapters=adapters)
        seconds = time.perf_counter() - start
    finally:
        engine.step = inner
    decode_steps = steps[-(tokens - 2):]  # the prefill steps come first
    return sum(len(o.token_ids) for o in outs) / seconds, statistics.median(decode_steps)


class OpClock:
    """Seconds by op class inside the forward, from forward hooks and wrapped LoRA applies."""

    def __init__(self, model):
        self.seconds: dict[str, float] = defaultdict(float)
        self._starts: dict[int, float] = {}
        self.handles = []
        for module in model.modules():
            kind = ("projections" if isinstance(module, Linear) else "attention"
                    if isinstance(module, PagedAttention) else "lm_head"
                    if isinstance(module, LMHead) else None)
            if kind is not None:
                self.handles.append(module.register_forward_pre_hook(self._enter))
                self.handles.append(module.register_forward_hook(self._leave(kind)))
        self._apply = LoRABuffers.apply
        clock = self

        def apply(buffers, *args, **kwargs):
            start = time.perf_counter()
            try:
                return clock._apply(buffers, *args, **kwargs)
            finally:
                clock.seconds["lora"] += time.perf_counter() - start

        LoRABuffers.apply = apply

    def _enter(self, module, _inputs) -> None:
        self._starts[id(module)] = time.perf_counter()

    def _leave(self, kind: str):
        def hook(module, _inputs, _output) -> None:
            self.seconds[kind] += time.perf_counter() - self._starts.pop(id(module))
        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        LoRABuffers.apply = self._apply


def profile(llm: LLM, names: list[str], tokens: int, vocab: int) -> dict[str, float]:
    """Median milliseconds by op class over the run's decode steps (LoRA runs inside the
    projections; it is taken out of them here)."""
    runner, engine = llm.engine.runner, llm.engine
    clock = OpClock(runner.model)
    now: dict[str, float] = defaultdict(float)
    steps: list[dict[str, float]] = []
    forward, sample, step = runner.forward, engine.sampler.__class__.__call__, engine.step

    def timed_step():
        now.clear()
        clock.seconds.clear()
        out = timed(now, "step", step)()
        s = clock.seconds
        parts = {"projections": s["projections"] - s["lora"], "LoRA": s["lora"],
                 "attention": s["attention"], "lm_head": s["lm_head"]}
        parts["norms, rotary, activations"] = now["forward"] - sum(parts.values())
        parts["sampling"] = now["sample"]
        parts["host"] = now["step"] - now["forward"] - now["sample"]
        steps.append(parts)
        return out

    runner.forward = timed(now, "forward", forward)
    engine.sampler.__class__.__call__ = timed(now, "sample", sample)
    engine.step = timed_step
    try:
        engine_tok_s(llm, names, tokens, vocab)
    finally:
        runner.forward, engine.step = forward, step
        engine.sampler.__class__.__call__ = sample
        clock.close()
    decode = steps[-(tokens - 2):]  # the warm-up and prefill steps come first
    return {k: statistics.median(p[k] for p in decode) * 1e3 for k in decode[0]}


def vllm_tok_s(python: str, model: str, adapters: list[str], tokens: int, vocab: int) -> dict:
    spec = {"model": model, "dtype": "float32", "tokens": tokens, "vocab": vocab,
            "prompt_len": PROMPT_LEN, "batches": [BATCH],
            "adapters": {f"a{i:02d}": d for i, d in enumerate(adapters)}}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "OMP_NUM_THREADS": str(os.cpu_count())}
    out = subprocess.run([python, os.path.join(os.path.dirname(__file__), "vllm_decode.py"),
                          json.dumps(spec)], capture_output=True, text=True, env=env,
                         timeout=1800)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--root", default=tempfile.gettempdir())
    ap.add_argument("--vllm-python", help="python of a venv with vLLM's CPU build")
    args = ap.parse_args()
    from transformers import AutoConfig

    model = build_llama25m_with_tokenizer(args.root)  # vLLM needs the tokenizer files
    hf = AutoConfig.from_pretrained(model)
    dirs = write_adapters(os.path.join(args.root, "loragw-bench-llama25m-tok-all7"), hf, TARGETS,
                          ADAPTERS, seed=11, rank=RANK)
    dtypes = [torch.float32] + ([torch.bfloat16] if has_bf16() else [])
    peaks = {d: gemm_peak(d) for d in dtypes}
    bandwidth = copy_bandwidth()
    print(f"machine: {machine()}")
    for d, (peak, how) in peaks.items():
        print(f"GEMM peak {str(d)[6:]}: {peak / 1e9:.0f} GFLOP/s ({how}, 2048^3)")
    print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (256 MiB, read + write)")

    rows, profiles = [], {}
    for name, options, c_lora in CONFIGS:
        if options.get("dtype") == "bfloat16" and not has_bf16():
            continue
        dtype = getattr(torch, options.get("dtype", "float32"))
        llm = LLM(model, device="cpu", max_num_seqs=BATCH, max_loras=ADAPTERS,
                  max_lora_rank=RANK, max_model_len=512, **{"dtype": "float32", **options})
        names = []
        for i, path in enumerate(dirs):
            names.append(f"a{i:02d}")
            llm.add_adapter(names[-1], path)
        usable = cpu_lora.usable
        if not c_lora:  # the bag path in torch, as before the C kernel
            cpu_lora.usable = lambda out, x: False
        try:
            for with_adapters in (False, True):
                use = names if with_adapters else []
                tok_s, step = engine_tok_s(llm, use, args.tokens, hf.vocab_size)
                flops, moved = decode_cost(llm, BATCH, len(use), PROMPT_LEN + args.tokens // 2)
                roof = max(flops / peaks[dtype][0], moved / bandwidth)
                rows.append((name, dtype, len(use), tok_s, step, roof))
                print(rows[-1], flush=True)
                if dtype == torch.float32:
                    profiles[(name, len(use))] = profile(llm, use, 32, hf.vocab_size)
        finally:
            cpu_lora.usable = usable
        del llm
    vllm = None
    if args.vllm_python:
        vllm = vllm_tok_s(args.vllm_python, model, dirs, args.tokens, hf.vocab_size)
        print("vLLM", vllm, flush=True)

    print(f"\n32 requests x {PROMPT_LEN}-token prompts x {args.tokens} greedy tokens, batch "
          f"{BATCH} decode; {ADAPTERS} rank-{RANK} adapters on all seven projections\n")
    print("| engine | adapters | tok/s | decode step ms | roofline step ms | step at roofline |"
          " vs vLLM |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, dtype, n, tok_s, step, roof in rows:
        ratio = ""
        if vllm and dtype == torch.float32:
            ratio = f"{tok_s / vllm[f'{BATCH}:{int(n > 0)}']:.2f}x"
        print(f"| {name} | {n} | {tok_s:.0f} | {step * 1e3:.1f} | {roof * 1e3:.2f} | "
              f"{roof / step:.0%} | {ratio} |")
    if vllm:
        for n in (0, ADAPTERS):
            print(f"| vLLM CPU float32 | {n} | {vllm[f'{BATCH}:{int(n > 0)}']:.0f} | | | | |")
    print("\nms per decode step by op class (float32):\n")
    classes = list(next(iter(profiles.values())))
    print("| engine | adapters | " + " | ".join(classes) + " |")
    print("|---|---:|" + "---:|" * len(classes))
    for (name, n), parts in profiles.items():
        print(f"| {name} | {n} | " + " | ".join(f"{parts[c]:.2f}" for c in classes) + " |")


if __name__ == "__main__":
    main()
