"""Mixture-of-Experts bases (engine/models/moe.py): greedy tokens equal transformers' for every
MoE architecture under batching, chunked prefill and preemption, with top-k 1 and 2; a fused
checkpoint loads to the same tokens as a per-expert one; attention LoRAs, and Qwen2-MoE's shared
expert and its gate as LoRA targets, equal PEFT's in a batch mixed with base rows; parameter
counts; what is refused at start-up."""

import json
import os
import shutil

import pytest
import safetensors.torch
import torch
from peft_reference import MAX_TOKENS as PEFT_MAX_TOKENS
from peft_reference import World, hf_greedy, load_peft, peft_greedy, save_peft_adapters

from loragw.engine import LLM, SamplingParams
from loragw.engine.distributed.shard import Shard
from loragw.engine.models import adapter_spec
from loragw.engine.models.moe import PER_EXPERT_KEY, MoeForCausalLM

MAX_TOKENS = 16
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
VARIANTS = {
    "mixtral-top2": ("mixtral", {}),
    "mixtral-top1": ("mixtral", {"num_experts_per_tok": 1}),
    "qwen2_moe-shared-dense-layer": ("qwen2_moe", {}),
    "qwen2_moe-top1-norm": ("qwen2_moe", {"num_experts_per_tok": 1, "norm_topk_prob": True}),
    "qwen3_moe-sparse-step": ("qwen3_moe", {}),
    "olmoe": ("olmoe", {}),
    "olmoe-clip-qkv": ("olmoe", {"clip_qkv": 0.4, "num_experts_per_tok": 1}),
}
SCHEDULES = {
    "batched": {},
    "chunked-prefill": {"max_num_batched_tokens": 8},
    "preempted": {"num_kv_blocks": 24, "block_size": 4},
}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def prompts(n: int = 6, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 500, (k,), generator=g).tolist() for k in (1, 5, 17, 40, 3, 29)[:n]]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(tiny_checkpoint, variant):
    arch, overrides = VARIANTS[variant]
    path = tiny_checkpoint(arch, **overrides)
    batch = prompts()
    expected = hf_greedy(path, batch, MAX_TOKENS)
    assert len({tuple(e) for e in expected}) > 1, "degenerate checkpoint: every output is equal"
    for name, schedule in SCHEDULES.items():
        llm = LLM(path, device="cpu", dtype="float32", **schedule)
        for prompt, out, want in zip(batch, llm.generate(batch, PARAMS), expected, strict=True):
            assert out.token_ids == want, f"{variant}/{name}: prompt of {len(prompt)} differs"
        engine = llm.engine
        assert engine.num_free_kv_blocks == engine.block_manager.num_blocks, "leaked KV blocks"
        if name == "preempted":
            assert engine.scheduler.num_preemptions > 0, "the schedule did not force preemption"


def fuse_experts(src: str, out: str) -> str:
    """A copy of checkpoint `src` with its per-expert tensors stacked into transformers 5's
    in-memory names (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I])
    and Mixtral's `block_sparse_moe` renamed `mlp`."""
    shutil.copytree(src, out, dirs_exist_ok=True)
    path = os.path.join(out, "model.safetensors")
    weights = safetensors.torch.load_file(path)
    fused: dict[str, torch.Tensor] = {}
    per_layer: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in weights.items():
        if m := PER_EXPERT_KEY.fullmatch(name):
            per_layer.setdefault(m["layer"], {}).setdefault(int(m["expert"]), {})[m["proj"]] = tensor
        else:
            fused[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
    for layer, experts in per_layer.items():
        gate_up, down = [], []
        for e in sorted(experts):
            w = experts[e]
            gate, up, dn = (w.get(a, w.get(b)) for a, b in (("w1", "gate_proj"), ("w3", "up_proj"),
                                                            ("w2", "down_proj")))
            gate_up.append(torch.cat([gate, up]))
            down.append(dn)
        fused[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{layer}.mlp.experts.down_proj"] = torch.stack(down)
    safetensors.torch.save_file(fused, path, metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_fused_checkpoint_loads_to_the_same_tokens(tiny_checkpoint, tmp_path, arch):
    path = tiny_checkpoint(arch)
    fused = fuse_experts(path, str(tmp_path / "fused"))
    names = safetensors.torch.load_file(os.path.join(fused, "model.safetensors"))
    assert not any(PER_EXPERT_KEY.fullmatch(n) for n in names), "still per expert"
    batch = prompts(4)
    want = [o.token_ids for o in LLM(path, device="cpu", dtype="float32").generate(batch, PARAMS)]
    got = [o.token_ids for o in LLM(fused, device="cpu", dtype="float32").generate(batch, PARAMS)]
    assert got == want


def test_a_checkpoint_missing_an_expert_is_refused(tiny_checkpoint, tmp_path):
    out = str(tmp_path / "missing")
    shutil.copytree(tiny_checkpoint("olmoe"), out)
    path = os.path.join(out, "model.safetensors")
    weights = safetensors.torch.load_file(path)
    del weights["model.layers.1.mlp.experts.3.up_proj.weight"]
    safetensors.torch.save_file(weights, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj:3:up_proj"):
        LLM(out, device="cpu", dtype="float32")


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_attention_lora_matches_peft_beside_base_rows(tiny_checkpoint, tmp_path, arch):
    base = tiny_checkpoint(arch)
    specs = {"attn-r4": dict(r=4, lora_alpha=8, target_modules=ATTENTION),
             "qv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])}
    dirs = save_peft_adapters(base, str(tmp_path / "adapters"), specs, seed=1)
    requests = ["attn-r4", None, "qv-r8", "attn-r4", None, "qv-r8"]
    batch = prompts(len(requests), seed=3)
    oracle = load_peft(base, dirs)
    oracle.get_base_model().generation_config.eos_token_id = None  # the engine ignores EOS
    with torch.inference_mode():
        expected = peft_greedy(oracle, batch, requests, MAX_TOKENS)
        plain = peft_greedy(oracle, batch, [None] * len(batch), MAX_TOKENS)
    for want, base_tokens, adapter in zip(expected, plain, requests, strict=True):
        assert (want != base_tokens) == (adapter is not None), f"{adapter} changes nothing"
    llm = LLM(base, device="cpu", dtype="float32", max_loras=2, max_lora_rank=8,
              lora_backend="torch")
    for name, path in dirs.items():
        llm.add_adapter(name, path)
    outputs = llm.generate(batch, PARAMS, adapters=requests)
    for i, (out, want) in enumerate(zip(outputs, expected, strict=True)):
        assert out.token_ids == want, f"{arch}: request {i} ({requests[i]}) differs from PEFT"


def test_router_and_shared_expert_are_lora_targets(tiny_checkpoint):
    """The slot pool attaches LoRA to whatever lora_linears yields, by slice name."""
    llm = LLM(tiny_checkpoint("qwen2_moe"), device="cpu", dtype="float32")
    model = llm.engine.runner.model
    slices = {(i, s) for i, linear in model.lora_linears() for s in linear.slice_names}
    for sparse in (0, 2):
        assert {(sparse, "gate"), (sparse, "shared_expert_gate"), (sparse, "gate_proj"),
                (sparse, "down_proj"), (sparse, "q_proj")} <= slices
    assert (1, "gate") not in slices and (1, "up_proj") in slices  # mlp_only_layers: dense
    shared = model.model.layers[0].mlp.shared_expert.gate_up_proj  # adapter targets of its slices
    assert shared.lora_names == ("shared_expert.gate_proj", "shared_expert.up_proj")
    assert [i for i, _ in model.expert_modules()] == [0, 2]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_parameter_counts(tiny_checkpoint, arch):
    from transformers import AutoModelForCausalLM

    from loragw.engine.snapshot import engine_info

    path = tiny_checkpoint(arch)
    hf = AutoModelForCausalLM.from_pretrained(path)
    llm = LLM(path, device="cpu", dtype="float32")
    total, active = llm.engine.runner.model.parameter_counts()
    assert total == hf.num_parameters()
    cfg = hf.config
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    k = cfg.num_experts_per_tok
    E = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    assert active == total - experts + experts * k // E
    info = engine_info(llm.engine)
    assert (info.total_parameters, info.active_parameters) == (total, active)


def test_dense_models_count_every_parameter_active(tiny_checkpoint):
    from loragw.engine.snapshot import engine_info

    info = engine_info(LLM(tiny_checkpoint("llama"), device="cpu", dtype="float32").engine)
    assert info.total_parameters == info.active_parameters > 0


def test_unsupported_architecture_is_named_at_start(tiny_checkpoint, tmp_path):
    out = str(tmp_path / "deepseek")
    shutil.copytree(tiny_checkpoint("llama"), out)
    config_path = os.path.join(out, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["architectures"], config["model_type"] = ["DeepseekV3ForCausalLM"], "deepseek_v3"
    with open(config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"'DeepseekV3ForCausalLM' is not supported.*"
                                         r"MixtralForCausalLM.*OlmoeForCausalLM"):
        LLM(out, device="cpu", dtype="float32")


def test_tensor_parallelism_and_unimplemented_switches_are_refused(tiny_checkpoint):
    with open(os.path.join(tiny_checkpoint("mixtral"), "config.json")) as f:
        config = json.load(f)
    with torch.device("meta"), pytest.raises(ValueError, match="tensor_parallel_size 1"):
        MoeForCausalLM(MoeForCausalLM.make_args(config), Shard(0, 2))
    for bad, what in (({"sliding_window": 4096}, "sliding-window"),
                      ({"hidden_act": "gelu"}, "hidden_act")):
        with pytest.raises(ValueError, match=what):
            MoeForCausalLM.make_args(config | bad)


def test_the_graph_safe_expert_path_equals_the_grouped_one():
    """Under CUDA graph capture each expert runs over every row (no host sync); same result."""
    from loragw.engine.layers.moe import Experts

    torch.manual_seed(0)
    experts = Experts(5, 16, 12)
    for p in experts.parameters():
        p.data.normal_()
    ids = torch.randint(0, 5, (9 * 2,))
    rows = torch.randn(ids.numel(), 16)
    ids, _ = ids.sort()
    grouped = experts._segments(ids)(rows, experts.gate_up_proj, ids)
    torch.testing.assert_close(experts._every_expert(rows, experts.gate_up_proj, ids), grouped)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_the_block_is_bit_exact_with_transformers_in_bfloat16(arch):
    """Routing weights in the dtype transformers uses (Mixtral float32, the others the model's):
    the other choice moves bf16 outputs by 0.25-0.5 here."""
    from transformers import MixtralConfig, Qwen2MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    from loragw.engine.distributed.shard import ONE
    from loragw.engine.layers.moe import Routing, SparseMoeBlock
    from loragw.engine.models.llama import MLP, ModelArgs

    torch.manual_seed(0)
    if arch == "mixtral":
        hf = MixtralSparseMoeBlock(MixtralConfig(hidden_size=64, intermediate_size=96,
                                                 num_local_experts=5, num_experts_per_tok=2))
        ours = SparseMoeBlock(64, 96, Routing(5, 2, True, float32_weights=True))
    else:
        hf = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(
            hidden_size=64, moe_intermediate_size=48, shared_expert_intermediate_size=80,
            num_experts=5, num_experts_per_tok=2))
        shared = MLP(ModelArgs(1, 64, 80, 1, 4, 4, 16, 1e-6, False, None, False, 64), ONE)
        ours = SparseMoeBlock(64, 48, Routing(5, 2, False), shared)
    for p in hf.parameters():
        p.data.normal_(0, 0.3)
    hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
        if arch == "qwen2_moe":
            theirs = hf.shared_expert
            ours.shared_expert.gate_up_proj.weight.copy_(
                torch.cat([theirs.gate_proj.weight, theirs.up_proj.weight]))
            ours.shared_expert.down_proj.weight.copy_(theirs.down_proj.weight)
            ours.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)
    x = torch.randn(37, 64).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(ours(x), hf(x[None])[0])


# PEFT names the shared expert's projections gate_proj / up_proj / down_proj, so these also hit
# layer 1's dense MLP (mlp_only_layers, intermediate_size 128 against the shared expert's 80);
# all-linear takes the shared expert and its gate (an nn.Linear). PEFT 0.22 also converts these
# names onto the routed experts' fused parameters (target_parameters gate_up_proj / down_proj)
# and the router's (gate.weight); its adapter_config.json says which it did.
# No adapter is named "mlp": PEFT 0.21 saving one adapter of several drops keys that hold
# another adapter's name as a path component ("...mlp.shared_expert_gate.lora_A.gate-q").
SHARED_EXPERT_ADAPTERS = {
    "ffn": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "gate-q": dict(r=8, lora_alpha=4, target_modules=["shared_expert_gate", "q_proj"]),
    "all-linear": dict(r=2, lora_alpha=4, target_modules="all-linear",
                       rank_pattern={"shared_expert.down_proj": 6}),
}
MOE_LAYERS = (0, 2)  # the tiny qwen2_moe's layer 1 is dense (mlp_only_layers)


def _routed(adapter_dir: str) -> set[tuple[int, str]]:
    """The (layer, target)s PEFT's saved config put on the MoE blocks' parameters."""
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        params = set(json.load(f).get("target_parameters") or ())
    names = {"gate_up_proj": "experts.gate_up_proj", "down_proj": "experts.down_proj",
             "gate.weight": "gate"}
    return {(i, target) for param, target in names.items() if param in params
            for i in MOE_LAYERS}


def test_shared_expert_lora_matches_peft_beside_base_rows(tiny_checkpoint, tmp_path):
    from loragw.adapters.format import read_adapter

    base = tiny_checkpoint("qwen2_moe")
    # apart: PEFT 0.22 holds target_parameters adapters together only when they target the same
    world = World(str(tmp_path), SHARED_EXPERT_ADAPTERS, base=base, apart=True)
    with open(os.path.join(base, "config.json")) as f:
        spec = adapter_spec(json.load(f), max_lora_rank=16)
    held = {name: set(read_adapter(path, spec).modules) for name, path in world.dirs.items()}
    routed = {name: _routed(path) for name, path in world.dirs.items()}
    shared = {(i, f"shared_expert.{t}") for i in MOE_LAYERS for t in ("gate_proj", "up_proj",
                                                                       "down_proj")}
    dense = {(1, t) for t in ("gate_proj", "up_proj", "down_proj")}
    assert held["ffn"] == shared | dense | routed["ffn"]
    assert held["gate-q"] == {(i, "shared_expert_gate") for i in MOE_LAYERS} | {
        (i, "q_proj") for i in range(3)} | routed["gate-q"]
    assert shared | dense | {(0, "shared_expert_gate"), (0, "o_proj")} | routed["all-linear"] <= (
        held["all-linear"])
    assert {(i, "gate") for i in MOE_LAYERS} & held["all-linear"] == {
        (i, "gate") for i in MOE_LAYERS} & routed["all-linear"], "the router only as PEFT put it"
    params = SamplingParams(max_tokens=PEFT_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for options in ({}, {"max_loras": 2, "max_num_batched_tokens": 8}):
        llm = world.llm(**options)
        world.check(llm.generate(world.prompts, params, adapters=world.requests),
                    f"qwen2_moe shared expert {options}")
