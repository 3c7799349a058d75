"""Quantized projections on one GPU: the Triton GEMM (kernels/quant_triton.py) vs bf16 and vs
dequantize-then-GEMM, at Llama-3-8B's projection shapes.

    python benchmarks/bench_quant_gpu.py --out bench_quant_gpu.md [--quick]

For every shape x weight (W4A16 groups of 128, W8A16 per channel, FP8 blocks of 128 on sm_89+)
x tokens (1, 16, 64, 256: decode batches and a prefill chunk) it times quant_matmul, F.linear on
the bf16 weight, and dequant_linear (the engine's fallback), with CUDA events; "GB/s" is the
quantized weight's bytes over the Triton time, "% copy" that over the device-to-device copy
bandwidth measured at start (decode GEMMs are weight-bound: that is the kernel's efficiency).
Each output is checked against the bf16 GEMM of the dequantized weight.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.nn.functional as F

from loragw.kernels.quant import QuantWeight, dequant_linear, dequantize, pack_int4

log = logging.getLogger("bench_quant_gpu")
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TOKENS = (1, 16, 64, 256)


def weight(kind: str, rows: int, columns: int, device: torch.device) -> QuantWeight:
    g = torch.Generator(device="cpu").manual_seed(0)
    if kind == "int4":
        q = torch.randint(-8, 8, (rows, columns), generator=g, dtype=torch.int8)
        return QuantWeight("int4", pack_int4(q).to(device),
                           torch.rand(rows, columns // 128, generator=g).to(device) * 0.02,
                           None, 128, columns)
    if kind == "int8":
        q = torch.randint(-127, 128, (rows, columns), generator=g, dtype=torch.int8)
        return QuantWeight("int8", q.to(device), torch.rand(rows, 1, generator=g).to(device)
                           * 0.002, None, columns, columns)
    q = (torch.randn(rows, columns, generator=g) * 100).to(torch.float8_e4m3fn)
    return QuantWeight("fp8", q.view(torch.uint8).to(device),
                       torch.rand(rows, columns // 128, generator=g).to(device) * 0.001,
                       None, 128, columns)


def timed(fn, repeats: int) -> float:
    """Microseconds per call (CUDA events, after a warm-up)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats


def copy_bandwidth(device: torch.device) -> float:
    src = torch.empty(512 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (timed(lambda: dst.copy_(src), 20) * 1e-6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="bench_quant_gpu.md")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    from loragw.kernels.quant_triton import quant_matmul, triton_supports

    device = torch.device("cuda")
    copy = copy_bandwidth(device)
    repeats = 10 if args.quick else 50
    lines = [f"GPU: {torch.cuda.get_device_name()}; copy {copy / 1e9:.0f} GB/s", "",
             "| shape | weights | tokens | triton us | bf16 us | dequant+GEMM us | GB/s | "
             "% copy | vs bf16 | max err |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (name, (rows, columns)), kind in ((s, k) for s in SHAPES.items()
                                          for k in ("int4", "int8", "fp8")):
        if not triton_supports(kind, device):
            lines.append(f"| {name} | {kind} | - | needs sm_89 | | | | | | |")
            continue
        w = weight(kind, rows, columns, device)
        dense = dequantize(w, torch.bfloat16)
        for tokens in TOKENS[:2] if args.quick else TOKENS:
            x = torch.randn(tokens, columns, device=device, dtype=torch.bfloat16)
            ours = timed(lambda x=x, w=w: quant_matmul(x, w), repeats)
            bf16 = timed(lambda x=x, dense=dense: F.linear(x, dense), repeats)
            fallback = timed(lambda x=x, w=w: dequant_linear(x, w), repeats)
            want = F.linear(x.float(), dense.float())
            err = ((quant_matmul(x, w).float() - want).abs() / (want.abs() + 1)).max().item()
            gbps = w.num_bytes / (ours * 1e-6)
            lines.append(f"| {name} {rows}x{columns} | {kind} | {tokens} | {ours:.1f} | "
                         f"{bf16:.1f} | {fallback:.1f} | {gbps / 1e9:.0f} | {gbps / copy:.0%} | "
                         f"{bf16 / ours:.2f}x | {err:.3f} |")
            log.info(lines[-1])
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
