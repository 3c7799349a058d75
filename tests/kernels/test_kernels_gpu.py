"""Compiled Triton kernels on a real GPU at Llama-3-8B shapes, and CUDA-graph replay."""

import importlib
from itertools import pairwise

import pytest
import torch
from lora_cases import Case, make_problem

from loragw.kernels import apply_lora, make_lora_meta

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled Triton kernels)"),
]


@pytest.fixture(scope="module")
def lt():
    module = importlib.import_module("loragw.kernels.lora_triton")
    if module.INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 is set: unset it to test the compiled kernels")
    return module


def slot_oracle(p):
    """float64 per-slot loop of apply_lora on the GPU. Returns the expected out [T, O]."""
    out = p.out0.double().clone()                                           # [T, O]
    for slot in p.token_slots.unique().tolist():
        if slot < 0:
            continue
        idx = (p.token_slots == slot).nonzero().squeeze(1)                 # [c]
        x = p.x[idx].double()                                               # [c, H]
        for i, (lo, hi) in enumerate(pairwise(p.slice_offsets)):
            r = int(p.ranks[i, slot])
            if r:
                y = x @ p.lora_a[i, slot, :r].double().T                    # [c, r]
                delta = y @ p.lora_b[slot, lo:hi, :r].double().T            # [c, w]
                out[idx, lo:hi] += float(p.scales[i, slot]) * delta
    return out


LLAMA = [  # (H, output slice widths): qkv (GQA), o, gate_up, down
    (4096, (4096, 1024, 1024)), (4096, (4096,)), (4096, (14336, 14336)), (14336, (4096,))]


BF16, FP16 = torch.bfloat16, torch.float16


@pytest.mark.parametrize("T,popularity,dtype", [
    (1, "distinct", BF16), (7, "uniform", FP16), (64, "distinct", BF16), (256, "zipf", FP16),
    (300, "identical", BF16), (1000, "skewed", FP16)], ids=str)
@pytest.mark.parametrize("H,widths", LLAMA, ids=["qkv", "o", "gate_up", "down"])
def test_compiled_kernels_at_llama_shapes(lt, dtype, T, popularity, H, widths):
    case = Case(popularity, rank=64, dtype=dtype, T=T, S=16, H=H, widths=widths, mixed_ranks=True,
                seed=T + H)
    p = make_problem(case, "cuda")
    meta = make_lora_meta(p.token_slots, case.S)
    out = p.out0.clone()
    apply_lora(out, p.x, p.lora_a, p.lora_b, p.ranks, p.scales, p.slice_offsets, meta, "triton")
    untouched = p.untouched().cuda()
    assert torch.equal(out[untouched], p.out0[untouched])
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.double(), slot_oracle(p), atol=tol, rtol=tol)


def test_cuda_graph_replays_with_new_metadata(lt):
    """The grid is fixed per (T, S): capture once, copy a new step's meta in, replay."""
    T, S = 64, 8
    problems = [make_problem(Case(pop, rank=32, dtype=BF16, T=T, S=S, H=1024, widths=(1024, 256, 256),
                                  mixed_ranks=True, seed=k), "cuda")
                for k, pop in enumerate(["uniform", "identical", "distinct", "all-none"])]
    first = problems[0]
    weights = dict(lora_a=first.lora_a.nan_to_num(0.0), lora_b=first.lora_b.nan_to_num(0.0),
                   ranks=first.ranks, scales=first.scales, slice_offsets=first.slice_offsets)
    x, out = first.x.nan_to_num(0.0), first.out0.clone()                   # static [T, H], [T, O]
    meta = make_lora_meta(first.token_slots, S)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        apply_lora(out, x, meta=meta, backend="triton", **weights)         # compile, fill caches
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_lora(out, x, meta=meta, backend="triton", **weights)

    for p in problems[1:]:  # new traffic through the captured weights: x, out and meta change
        p.x = p.x.nan_to_num(0.0)
        p.lora_a, p.lora_b = weights["lora_a"], weights["lora_b"]
        p.ranks, p.scales = weights["ranks"], weights["scales"]
        x.copy_(p.x)
        out.copy_(p.out0)
        make_lora_meta(p.token_slots, S, out=meta)
        graph.replay()
        torch.testing.assert_close(out.double(), slot_oracle(p), atol=2e-2, rtol=2e-2)
