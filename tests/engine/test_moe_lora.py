"""Expert LoRA on MoE bases (PEFT's target_parameters): apply_expert_lora against a float64
reference over the traffic shapes a multi-LoRA server sees, and mixed batches of attention-only,
expert, router and base requests giving exactly PEFT's greedy tokens on tiny Mixtral-like and
Qwen3-MoE-like checkpoints (tests/checkpoints.py), with as many slots as adapters and with two.
"""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from peft_reference import MAX_TOKENS, World

from loragw.engine import SamplingParams
from loragw.engine.forward.context import ForwardContext, forward_context
from loragw.engine.forward.lora import LoRARows, LoRAStep
from loragw.engine.layers import moe_lora
from loragw.engine.layers.moe_lora import ExpertLoRABuffers, apply_expert_lora
from loragw.engine.runner.graphs import DecodeGraphs

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
S, E, R, IN, OUT = 4, 5, 8, 24, 40
SLOT_RANKS = (8, 3, 0, 5)  # slot 2 holds an adapter without this expert LoRA


def make_buffers(dtype: torch.dtype, seed: int = 0) -> ExpertLoRABuffers:
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(S, E, R, IN, dtype=dtype)
    b = torch.zeros(S, E, OUT, R, dtype=dtype)
    scales = torch.zeros(S)
    for s, r in enumerate(SLOT_RANKS):
        if r:  # past its rank a slot's factors are zero, as the slot pool leaves them
            a[s, :, :r] = torch.randn(E, r, IN, generator=g).to(dtype)
            b[s, :, :, :r] = torch.randn(E, OUT, r, generator=g).to(dtype)
            scales[s] = 0.5 + s
    return ExpertLoRABuffers(a, b, scales, list(SLOT_RANKS))


def reference(buffers: ExpertLoRABuffers, y, x, expert_ids, token_index, token_slots):
    """The docstring's line, row by row, in float64."""
    out = y.double().clone()
    for i, (e, t) in enumerate(zip(expert_ids.tolist(), token_index.tolist(), strict=True)):
        s = token_slots[t]
        if s < 0 or not buffers.ranks[s]:
            continue
        r = buffers.ranks[s]
        a, b = buffers.lora_a[s, e, :r].double(), buffers.lora_b[s, e, :, :r].double()
        out[i] += float(buffers.scales[s]) * (b @ (a @ x[i].double()))
    return out


def popularity(kind: str, num_tokens: int, g: torch.Generator) -> list[int]:
    """Each token's slot (-1: the base model) under one traffic shape."""
    if kind == "distinct":
        return [t % S for t in range(num_tokens)]
    if kind == "identical":
        return [1] * num_tokens
    if kind == "skewed":  # mostly slot 0, a few others and base rows
        return [0 if t % 4 else (t // 4) % (S + 1) - 1 for t in range(num_tokens)]
    return torch.randint(-1, S, (num_tokens,), generator=g).tolist()  # uniform, base included


def grouped_rows(num_tokens: int, top_k: int, g: torch.Generator):
    """What engine/layers/moe.py hands over: (token, choice) pairs sorted by expert."""
    topk = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(num_tokens)])
    flat = topk.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return flat[order], order // top_k  # expert_ids [N], token_index [N]


def run(buffers, y, x, expert_ids, token_index, token_slots, experts: bool = True):
    step = LoRAStep.build(LoRARows(token_slots, [], S, embed=False, head=False,
                                   experts=experts), torch.device("cpu"))
    with forward_context(ForwardContext(attn=None, lora=step)):
        apply_expert_lora({"down_proj": buffers}, "down_proj", y, x, expert_ids, token_index)


@pytest.mark.parametrize("path", ["segments", "gathered"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["distinct", "uniform", "identical", "skewed"])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_apply_expert_lora_matches_reference(dtype, kind, num_tokens, path, monkeypatch):
    monkeypatch.setattr(moe_lora, "SEGMENT_ROWS", 0 if path == "segments" else 10**9)
    g = torch.Generator().manual_seed(num_tokens)
    buffers = make_buffers(dtype)
    token_slots = popularity(kind, num_tokens, g)
    expert_ids, token_index = grouped_rows(num_tokens, 2, g)
    x = torch.randn(len(expert_ids), IN, generator=g).to(dtype)
    y = torch.randn(len(expert_ids), OUT, generator=g).to(dtype)
    want = reference(buffers, y, x, expert_ids, token_index, token_slots)
    run(buffers, y, x, expert_ids, token_index, token_slots)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.5)
    torch.testing.assert_close(y.double(), want, **tol)


def test_segments_for_many_rows_a_pair_gathered_for_decode():
    assert moe_lora.use_segments(num_rows=512, num_pairs=16)  # prefill: 32 rows a pair
    assert not moe_lora.use_segments(num_rows=16, num_pairs=14)  # decode: ~1 row a pair


def test_chunks_give_the_same_rows(monkeypatch):
    monkeypatch.setattr(moe_lora, "SEGMENT_ROWS", 10**9)  # the gathered path
    g = torch.Generator().manual_seed(3)
    buffers = make_buffers(torch.float32)
    token_slots = popularity("uniform", 40, g)
    expert_ids, token_index = grouped_rows(40, 2, g)
    x, y = torch.randn(80, IN, generator=g), torch.randn(80, OUT, generator=g)
    whole = y.clone()
    run(buffers, whole, x, expert_ids, token_index, token_slots)
    monkeypatch.setattr(moe_lora, "GATHER_ELEMENTS", 3 * R * (IN + OUT))  # 3 rows a chunk
    assert moe_lora.rows_per_chunk(R, IN, OUT) == 3
    run(buffers, y, x, expert_ids, token_index, token_slots)
    torch.testing.assert_close(y, whole, rtol=1e-6, atol=1e-6)


def test_rows_without_expert_lora_are_untouched():
    g = torch.Generator().manual_seed(4)
    buffers = make_buffers(torch.float32)
    expert_ids, token_index = grouped_rows(6, 2, g)
    x, y = torch.randn(12, IN, generator=g), torch.randn(12, OUT, generator=g)
    before = y.clone()
    run(buffers, y, x, expert_ids, token_index, [-1, 2, -1, 2, 2, -1])  # base and slot 2 only
    assert torch.equal(y, before)
    run(buffers, y, x, expert_ids, token_index, [0] * 6, experts=False)  # step says: none
    assert torch.equal(y, before)
    apply_expert_lora(None, "down_proj", y, x, expert_ids, token_index)  # no pool: no context
    assert torch.equal(y, before)


def test_steps_with_expert_lora_run_outside_cuda_graphs():
    """Their rows and ranks are picked on the host, and a graph captured before the first
    expert adapter was registered holds no expert LoRA."""
    graphs = SimpleNamespace(buckets=[1, 2, 4])
    rows = LoRARows([0, -1], [], S, embed=False, head=False, experts=False)
    assert DecodeGraphs.key_for(graphs, 2, rows) is not None
    assert DecodeGraphs.key_for(graphs, 2, replace(rows, experts=True)) is None


# ---- parity with PEFT -----------------------------------------------------------------------
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
MOE_ADAPTERS = {
    "router-only-r2": dict(r=2, lora_alpha=16, target_parameters=["gate.weight"]),
    "attn-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "experts-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj"], target_parameters=EXPERTS),
    "experts-rslora-r2": dict(r=2, lora_alpha=4, use_rslora=True, target_parameters=EXPERTS),
    # the router too; PEFT saves target_modules "down_proj" as target_parameters "down_proj"
    # (the experts'; Qwen3-MoE's dense layers get no down_proj LoRA), served as PEFT reloads it
    "router-r4": dict(r=4, lora_alpha=4, target_modules=["v_proj", "down_proj"],
                      target_parameters=[*EXPERTS, "gate.weight"],
                      rank_pattern={"experts.down_proj": 6}, alpha_pattern={"gate.weight": 8}),
    "down-only-r3": dict(r=3, lora_alpha=6, target_modules=["o_proj"],
                         target_parameters=["experts.down_proj"]),
}
ENGINES = {"torch": {}, "torch-2-slots": dict(max_loras=2)}


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe_world(request, tiny_checkpoint, tmp_path_factory) -> World:
    """A tiny MoE base and MOE_ADAPTERS, each saved and answered by a PEFT model of its own
    (PEFT holds target_parameters adapters together only when they target the same ones)."""
    base = tiny_checkpoint(request.param)
    root = str(tmp_path_factory.mktemp(f"moe-lora-{request.param}"))
    return World(root, MOE_ADAPTERS, apart=True, base=base)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_mixed_batch_matches_peft(moe_world, engine):
    llm = moe_world.llm(**ENGINES[engine])
    outputs = llm.generate(moe_world.prompts, GREEDY, adapters=moe_world.requests)
    moe_world.check(outputs, engine)
    assert llm.engine.lora.slots_in_use == 0
    assert llm.engine.lora.device_bytes["experts"] > 0
