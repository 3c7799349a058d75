"""LoRA and decode-attention kernels on one GPU (bf16).

    python benchmarks/bench_kernels_gpu.py --out bench_kernels.md [--quick] [--block-m auto,16,64]
        [--kernels lora,attention]

Run from the repository root (or with the project installed). For every Llama-3-8B projection
shape x rank x batch x popularity (distinct: every token its own adapter; identical: one
adapter for all), it times:
    triton      apply_lora(backend="triton"): shrink + expand (y zeroing included)
    gather-bmm  gather each token's A and B, then two bmm (what a naive batched LoRA does)
    slot-loop   apply_lora(backend="torch"): per-slot index_select + matmul, a Python loop
and checks the Triton output against a float64 per-slot oracle. "GB/s" counts the bytes the
step must touch at least (x, the rank-r weights of the adapters it uses, y written and read,
out read and written) over the Triton time; "% copy" divides that by the device-to-device copy
bandwidth measured at start. Decode LoRA is memory-bound, so "% copy" is the kernel's
efficiency. `--block-m auto,1` adds rows for the same kernels with one token per program
(a BGMV: weights read once per token, products summed on CUDA cores instead of tl.dot): auto
vs 1 on distinct and identical traffic is the SGMV/BGMV question of kernels/lora_triton.py.

Decode attention (second table): kernels/paged_attention.py vs the engine's torch path
(PagedAttention._decode: index_select of each row's whole K/V blocks into a padded copy, then
SDPA under a mask; its block ids/mask are built outside the timing, once per step as in the
engine) at 32 q / 8 kv heads, head_dim 128, 16-token blocks scattered at random over the pool,
for each batch x context ("ragged": lengths uniform in [1, the largest context]). "KV GB/s" is
the K and V bytes of the contexts (the least either path must read) over the time; "% copy" as
above. Both outputs are checked against the float64 oracle (kernels/reference.py).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from itertools import pairwise, product

import torch

log = logging.getLogger("bench_kernels_gpu")

SHAPES = {  # name: (H, output slice widths), Llama-3-8B
    "q/o": (4096, (4096,)), "k/v": (4096, (1024,)), "gate/up": (4096, (14336,)),
    "down": (14336, (4096,)), "qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336)),
}
DTYPE = torch.bfloat16
TOLERANCE = 2e-2  # bf16 out: |got - want| <= tol + tol * |want|


@dataclass
class Row:
    shape: str
    rank: int
    batch: int
    popularity: str
    block_m: str
    triton_us: float
    gather_bmm_us: float
    slot_loop_us: float
    gbps: float
    copy_fraction: float
    max_err: float        # max |got - want| / (tol + tol * |want|): <= 1 passes

    def cells(self) -> list[str]:
        best = min(self.gather_bmm_us, self.slot_loop_us)
        ok = "ok" if self.max_err <= 1 else "FAIL"
        return [self.shape, str(self.rank), str(self.batch), self.popularity, self.block_m,
                f"{self.triton_us:.1f}", f"{self.gather_bmm_us:.1f}", f"{self.slot_loop_us:.1f}",
                f"{best / self.triton_us:.2f}x", f"{self.gbps:.0f}", f"{100 * self.copy_fraction:.1f}%",
                f"{self.max_err:.2f} {ok}"]


HEADER = ["shape", "rank", "batch", "popularity", "tile M", "triton us", "gather-bmm us",
          "slot-loop us", "speedup vs best baseline", "GB/s", "% copy", "err/tol"]


def bench_ms(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (bench_ms(lambda: dst.copy_(src)) * 1e-3)


def gather_bmm(out, x, lora_a, lora_b, token_slots, scales, slice_offsets):
    """out[:, o[i]:o[i+1]] += scale * (A[slot] @ x) gathered per token; every token has a slot."""
    for i, (lo, hi) in enumerate(pairwise(slice_offsets)):
        a = lora_a[i].index_select(0, token_slots)                  # [T, R, H]
        y = torch.bmm(a, x.unsqueeze(2))                             # [T, R, 1]
        b = lora_b[:, lo:hi].index_select(0, token_slots)            # [T, w, R]
        delta = torch.bmm(b, y).squeeze(2)                           # [T, w]
        out[:, lo:hi] += delta * scales[i].index_select(0, token_slots)[:, None]


def slot_oracle(out0, x, lora_a, lora_b, ranks, scales, slice_offsets, token_slots):
    """float64 per-slot loop; returns the expected out [T, O]."""
    out = out0.double()
    for slot in token_slots.unique().tolist():
        idx = (token_slots == slot).nonzero().squeeze(1)
        xs = x[idx].double()
        for i, (lo, hi) in enumerate(pairwise(slice_offsets)):
            r = int(ranks[i, slot])
            y = xs @ lora_a[i, slot, :r].double().T                  # [c, r]
            out[idx, lo:hi] += float(scales[i, slot]) * (y @ lora_b[slot, lo:hi, :r].double().T)
    return out


def min_bytes(T: int, H: int, out_features: int, n: int, R: int, r: int, active: int) -> int:
    e = DTYPE.itemsize
    return (T * H * e                      # x
            + active * n * r * H * e       # A, rank-r rows of the slots used
            + active * out_features * r * e  # B, rank-r columns
            + 2 * n * T * R * 4            # y written, then read (fp32)
            + 2 * T * out_features * e)    # out read and written


def run_one(shape, rank, batch, popularity, block_m, weights, copy_bw) -> Row:
    from loragw.kernels import apply_lora, make_lora_meta
    H, widths = SHAPES[shape]
    lora_a, lora_b, ranks, scales, offsets = weights
    S = lora_b.shape[0]
    slots = (torch.arange(batch, device="cuda") % S if popularity == "distinct"
             else torch.zeros(batch, dtype=torch.long, device="cuda"))
    meta = make_lora_meta(slots, S, block_m=None if block_m == "auto" else int(block_m))
    x = torch.randn(batch, H, device="cuda", dtype=DTYPE)
    out0 = torch.randn(batch, offsets[-1], device="cuda", dtype=DTYPE)

    out = out0.clone()
    apply_lora(out, x, lora_a, lora_b, ranks, scales, offsets, meta, backend="triton")
    want = slot_oracle(out0, x, lora_a, lora_b, ranks, scales, offsets, slots)
    err = ((out.double() - want).abs() / (TOLERANCE + TOLERANCE * want.abs())).max().item()

    out = out0.clone()
    t_triton = bench_ms(lambda: apply_lora(out, x, lora_a, lora_b, ranks, scales, offsets, meta, "triton"))
    t_bmm = bench_ms(lambda: gather_bmm(out, x, lora_a, lora_b, slots, scales, offsets))
    t_loop = bench_ms(lambda: apply_lora(out, x, lora_a, lora_b, ranks, scales, offsets, meta, "torch"))
    active = len(meta.segments)
    nbytes = min_bytes(batch, H, offsets[-1], len(widths), lora_a.shape[2], rank, active)
    gbps = nbytes / (t_triton * 1e-3) / 1e9
    return Row(shape, rank, batch, popularity, str(meta.block_m) if block_m == "auto" else block_m,
               1e3 * t_triton, 1e3 * t_bmm, 1e3 * t_loop, gbps, gbps * 1e9 / copy_bw, err)


def make_weights(shape: str, rank: int, num_slots: int):
    H, widths = SHAPES[shape]
    n, offsets = len(widths), (0, *torch.tensor(widths).cumsum(0).tolist())
    lora_a = (torch.randn(n, num_slots, rank, H, device="cuda") / H ** 0.5).to(DTYPE)  # [n, S, R, H]
    lora_b = (torch.randn(num_slots, offsets[-1], rank, device="cuda") / rank ** 0.5).to(DTYPE)  # [S, O, R]
    ranks = torch.full((n, num_slots), rank, dtype=torch.int32, device="cuda")
    scales = torch.full((n, num_slots), 2.0, device="cuda")
    return lora_a, lora_b, ranks, scales, offsets


def markdown(rows: list[Row], copy_bw: float) -> str:
    lines = [f"Device: {torch.cuda.get_device_name()}; device-to-device copy {copy_bw / 1e9:.0f} GB/s; "
             f"dtype bf16; torch {torch.__version__}", "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines) + "\n"


ATTN_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM, ATTN_BLOCK_SIZE = 32, 8, 128, 16


@dataclass
class AttentionRow:
    batch: int
    context: str          # tokens per sequence, or "ragged<=N"
    splits: int
    triton_us: float
    torch_us: float
    triton_gbps: float
    torch_gbps: float
    copy_fraction: float  # triton KV GB/s over device-to-device copy
    triton_err: float     # max |got - want| / (tol + tol * |want|): <= 1 passes
    torch_err: float

    def cells(self) -> list[str]:
        ok = lambda err: f"{err:.2f} {'ok' if err <= 1 else 'FAIL'}"
        return [str(self.batch), self.context, str(self.splits), f"{self.triton_us:.1f}",
                f"{self.torch_us:.1f}", f"{self.torch_us / self.triton_us:.2f}x",
                f"{self.triton_gbps:.0f}", f"{self.torch_gbps:.0f}",
                f"{100 * self.copy_fraction:.1f}%", ok(self.triton_err), ok(self.torch_err)]


ATTN_HEADER = ["batch", "context", "splits", "triton us", "gather+SDPA us", "speedup",
               "triton KV GB/s", "gather+SDPA KV GB/s", "% copy", "triton err/tol",
               "gather+SDPA err/tol"]


def run_attention(batch: int, context: str, max_context: int, copy_bw: float) -> AttentionRow:
    from loragw.engine.layers.attention import PagedAttention
    from loragw.kernels import paged_attention as pa
    from loragw.kernels.reference import oracle_paged_attention

    g = torch.Generator().manual_seed(batch)
    lens = (torch.randint(1, max_context + 1, (batch,), generator=g) if context.startswith("ragged")
            else torch.full((batch,), int(context)))
    bs, n_kv, D = ATTN_BLOCK_SIZE, ATTN_KV_HEADS, ATTN_HEAD_DIM
    need = (-(-lens // bs)).tolist()
    width, num_blocks = max(need), sum(need) + 8
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(batch, width, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(need):
        tables[b, :nb] = order[used:used + nb].int()
        used += nb
    k_cache = torch.randn(num_blocks, bs, n_kv, D, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, ATTN_HEADS, D, device="cuda", dtype=DTYPE)
    tables, lens = tables.cuda(), lens.to(device="cuda", dtype=torch.int32)
    scale = D ** -0.5

    layer = PagedAttention(ATTN_HEADS, n_kv, D, scale)
    layer.k_cache, layer.v_cache = k_cache, v_cache
    block_ids = tables.flatten().long()  # as ModelRunner._decode_addressing builds them
    mask = (torch.arange(width * bs, device="cuda")[None, :] < lens[:, None])[:, None, None, :]
    torch_path = lambda: layer._decode(q, block_ids, mask)
    out = torch.empty_like(q)
    kernel = lambda: pa.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale, out=out)

    want = oracle_paged_attention(q, k_cache, v_cache, tables, lens, scale)
    err = lambda got: ((got.double() - want).abs() / (TOLERANCE + TOLERANCE * want.abs())).max().item()
    triton_err, torch_err = err(kernel()), err(torch_path())
    t_triton, t_torch = bench_ms(kernel), bench_ms(torch_path)
    kv_bytes = 2 * int(lens.sum()) * n_kv * D * DTYPE.itemsize
    splits = pa.decode_config(batch, n_kv, D, q.device).num_splits
    gbps = lambda ms: kv_bytes / (ms * 1e-3) / 1e9
    return AttentionRow(batch, context, splits, 1e3 * t_triton, 1e3 * t_torch, gbps(t_triton),
                        gbps(t_torch), gbps(t_triton) * 1e9 / copy_bw, triton_err, torch_err)


def attention_markdown(rows: list[AttentionRow]) -> str:
    lines = [f"Decode attention: {ATTN_HEADS} q / {ATTN_KV_HEADS} kv heads, head_dim "
             f"{ATTN_HEAD_DIM}, block_size {ATTN_BLOCK_SIZE}, bf16", "",
             "| " + " | ".join(ATTN_HEADER) + " |", "|" + "---|" * len(ATTN_HEADER)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    csv = lambda kind: (lambda s: [kind(v) for v in s.split(",")])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_kernels.md", help="write the markdown table here")
    p.add_argument("--shapes", type=csv(str), default=["q/o", "k/v", "gate/up", "down", "qkv"],
                   help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--ranks", type=csv(int), default=[8, 16, 64])
    p.add_argument("--batches", type=csv(int), default=[1, 16, 64, 256])
    p.add_argument("--popularity", type=csv(str), default=["distinct", "identical"])
    p.add_argument("--block-m", type=csv(str), default=["auto"],
                   help="tile heights to compare: auto (the engine's rule) or powers of 2 >= 16")
    p.add_argument("--kernels", type=csv(str), default=["lora", "attention"],
                   help="which tables: lora, attention")
    p.add_argument("--attn-batches", type=csv(int), default=[1, 16, 64])
    p.add_argument("--attn-contexts", type=csv(str), default=["1024", "2048", "4096", "ragged"],
                   help="tokens per sequence, or ragged (uniform in [1, the largest given])")
    p.add_argument("--quick", action="store_true", help="qkv, gate/up, down; ranks 16,64; batches "
                   "1,32,256; attention at batch 64, contexts 1024,4096,ragged")
    args = p.parse_args(argv)
    if args.quick:
        args.shapes, args.ranks, args.batches = ["qkv", "gate/up", "down"], [16, 64], [1, 32, 256]
        args.attn_batches, args.attn_contexts = [64], ["1024", "4096", "ragged"]
    if set(args.kernels) - {"lora", "attention"}:
        p.error(f"--kernels takes lora and/or attention, got {args.kernels}")
    if any(c != "ragged" and not c.isdigit() for c in args.attn_contexts):
        p.error(f"--attn-contexts takes token counts and/or ragged, got {args.attn_contexts}")
    unknown = set(args.shapes) - set(SHAPES)
    if unknown:
        p.error(f"unknown shapes {sorted(unknown)}; choose from {', '.join(SHAPES)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels_gpu needs a CUDA device; run `pytest tests/kernels` on CPU instead")
    from tqdm import tqdm

    copy_bw = copy_bandwidth()
    log.info("device-to-device copy: %.0f GB/s", copy_bw / 1e9)
    tables, failed = [], 0
    if "lora" in args.kernels:
        rows = bench_lora(args, copy_bw)
        tables.append(markdown(rows, copy_bw))
        failed += sum(r.max_err > 1 for r in rows)
    if "attention" in args.kernels:
        numeric = [int(c) for c in args.attn_contexts if c != "ragged"]
        max_context = max(numeric, default=4096)
        contexts = [c if c != "ragged" else f"ragged<={max_context}" for c in args.attn_contexts]
        configs = list(product(args.attn_batches, contexts))
        attn_rows = [run_attention(batch, context, max_context, copy_bw)
                     for batch, context in tqdm(configs, desc="decode attention")]
        tables.append(attention_markdown(attn_rows))
        failed += sum(max(r.triton_err, r.torch_err) > 1 for r in attn_rows)
    report = "\n".join(tables)
    with open(args.out, "w") as f:
        f.write(report)
    print(report)
    if failed:
        raise SystemExit(f"{failed} configurations exceed the bf16 tolerance; see {args.out}")


def bench_lora(args: argparse.Namespace, copy_bw: float) -> list[Row]:
    from tqdm import tqdm

    num_slots = max(args.batches)  # distinct popularity gives every token its own slot
    rows = []
    configs = list(product(args.shapes, args.ranks))
    with tqdm(total=len(configs) * len(args.batches) * len(args.popularity) * len(args.block_m)) as bar:
        for shape, rank in configs:
            weights = make_weights(shape, rank, num_slots)
            for batch, popularity, block_m in product(args.batches, args.popularity, args.block_m):
                rows.append(run_one(shape, rank, batch, popularity, block_m, weights, copy_bw))
                bar.update()
            del weights
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
