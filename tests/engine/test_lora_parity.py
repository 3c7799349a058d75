"""Mixed-adapter batches give exactly PEFT's greedy tokens, and bad adapters are refused.

One tiny random Llama and six PEFT adapters (ranks 1 to 16; attention-only, MLP-only and all
seven targets; rslora; rank/alpha patterns; layers_to_transform), saved by PEFT itself. The
oracle is PeftModel with every adapter loaded, one greedy generate per request (float32, CPU).
"""

import os

import torch

if not torch.cuda.is_available():  # before anything imports triton (kernels import it lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402

import pytest  # noqa: E402
import safetensors.torch  # noqa: E402
from peft_reference import build_base, load_peft, peft_greedy, save_peft_adapters  # noqa: E402

from adapters.errors import AdapterError  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

MAX_TOKENS = 10
ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "attn-r1": dict(r=1, lora_alpha=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "all-r16-rslora": dict(r=16, lora_alpha=16, use_rslora=True, target_modules=ALL_SEVEN),
    "mlp-patterns": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"],
                         rank_pattern={"down_proj": 2}, alpha_pattern={"up_proj": 4}),
    "layer1-qvo": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                       layers_to_transform=[1]),
    "kv-layer-patterns": dict(r=2, lora_alpha=4, target_modules=["k_proj", "v_proj", "down_proj"],
                              rank_pattern={"layers.0.self_attn.k_proj": 12},
                              alpha_pattern={"layers.0.self_attn.k_proj": 3, "down_proj": 1}),
    "qv-r16": dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
}
# Every adapter twice and the base model three times, prompts of 1 to 23 tokens.
REQUESTS = [*ADAPTERS, None, *reversed(ADAPTERS), None, None]
QV = [i for i, adapter in enumerate(REQUESTS) if adapter == "qv-r16"]  # requests to replace under
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


class World:
    """The base checkpoint, the adapters, the requests and PEFT's answers, built once."""

    def __init__(self, root: str):
        self.base = build_base(os.path.join(root, "base"))
        self.dirs = save_peft_adapters(self.base, os.path.join(root, "adapters"), ADAPTERS, 1)
        # Same configs, other weights: what replacing an adapter must switch to.
        self.replacement = save_peft_adapters(self.base, os.path.join(root, "replacement"),
                                              {"qv-r16": ADAPTERS["qv-r16"]}, 2)["qv-r16"]
        g = torch.Generator().manual_seed(7)
        self.prompts = [torch.randint(0, 256, (n,), generator=g).tolist()
                        for n in (5, 1, 17, 9, 23, 3, 12, 7, 14, 2, 19, 6, 11, 8, 4)]
        assert len(self.prompts) == len(REQUESTS)
        oracle = load_peft(self.base, {**self.dirs, "replacement": self.replacement})
        with torch.inference_mode():
            self.expected = peft_greedy(oracle, self.prompts, REQUESTS)
            self.expected_replacement = peft_greedy(oracle, [self.prompts[i] for i in QV],
                                                    ["replacement"] * len(QV))
            self.expected_base = peft_greedy(oracle, self.prompts, [None] * len(self.prompts))

    def llm(self, **kwargs) -> LLM:
        options = dict(device="cpu", dtype="float32", max_loras=len(ADAPTERS), max_lora_rank=16)
        llm = LLM(self.base, **{**options, **kwargs})
        for name, path in self.dirs.items():
            llm.add_adapter(name, path)
        return llm


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    world = World(str(tmp_path_factory.mktemp("lora-parity")))
    for want, base, adapter in zip(world.expected, world.expected_base, REQUESTS, strict=True):
        assert (want != base) == (adapter is not None), f"adapter {adapter} changes nothing"
    assert len({tuple(e) for e in world.expected}) > len(REQUESTS) // 2, "degenerate checkpoint"
    return world


def assert_matches_peft(world: World, outputs, label: str) -> None:
    for i, (out, want, adapter) in enumerate(zip(outputs, world.expected, REQUESTS, strict=True)):
        assert out.token_ids == want, (
            f"{label}: request {i} (adapter {adapter}, prompt of {len(world.prompts[i])} tokens) "
            f"gave {out.token_ids}, PEFT {want}")


ENGINES = {
    "torch": dict(lora_backend="torch"),
    "torch-2-slots": dict(lora_backend="torch", max_loras=2),
    "torch-chunked-prefill": dict(lora_backend="torch", max_loras=3, max_num_batched_tokens=8),
    "triton": dict(lora_backend="triton"),
    "triton-2-slots-chunked": dict(lora_backend="triton", max_loras=2, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_mixed_batch_matches_peft(world, engine):
    if ENGINES[engine]["lora_backend"] == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend runs on CPU only under TRITON_INTERPRET=1; "
                    "tests/kernels/test_kernels_gpu.py covers it on GPUs")
    llm = world.llm(**ENGINES[engine])
    outputs = llm.generate(world.prompts, GREEDY, adapters=REQUESTS)
    assert_matches_peft(world, outputs, engine)
    assert llm.engine.num_free_kv_blocks == llm.engine.block_manager.num_blocks
    assert llm.engine.lora.slots_in_use == 0


def test_each_request_alone_equals_batched(world):
    """Alone, each request gives PEFT's tokens too, so batching never changes an output."""
    llm = world.llm(lora_backend="torch", max_loras=2)
    for i, (prompt, adapter) in enumerate(zip(world.prompts, REQUESTS, strict=True)):
        alone = llm.generate([prompt], GREEDY, adapters=[adapter])[0]
        assert alone.token_ids == world.expected[i], f"request {i} ({adapter}) alone"


# ---- refusing bad adapters ------------------------------------------------------------------
def peft_adapter(world: World, root: str, name: str, **spec) -> str:
    return save_peft_adapters(world.base, root, {name: spec}, seed=3)[name]


def edited_copy(src: str, dst: str, tensors: dict[str, torch.Tensor]) -> str:
    """A copy of adapter `src` with some of its tensors replaced."""
    os.makedirs(dst)
    with open(os.path.join(src, "adapter_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    weights = safetensors.torch.load_file(os.path.join(src, "adapter_model.safetensors"))
    safetensors.torch.save_file({**weights, **tensors},
                                os.path.join(dst, "adapter_model.safetensors"))
    return dst


def bad_adapters(world: World, root: str) -> dict[str, tuple[str, str]]:
    """name -> (adapter dir, what the refusal must mention)."""
    qv = world.dirs["qv-r16"]
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    return {
        "rank-32": (peft_adapter(world, root, "rank-32", r=32, lora_alpha=32,
                                 target_modules=["q_proj"]), "rank 32 > --max-lora-rank 16"),
        "other-model": (edited_copy(qv, os.path.join(root, "other-model"),
                                    {q_a: torch.randn(16, 96)}),
                        "lora_A [16, 96]"),
        "modules-to-save": (peft_adapter(world, root, "modules-to-save", r=4, lora_alpha=8,
                                         target_modules=["q_proj"], modules_to_save=["lm_head"]),
                            "modules_to_save is ['lm_head']: the adapter replaces whole modules"),
        "dora": (peft_adapter(world, root, "dora", r=4, lora_alpha=8, use_dora=True,
                              target_modules=["q_proj"]), "DoRA adapters are not supported"),
    }


def test_bad_adapters_are_refused_and_the_engine_keeps_serving(world, tmp_path):
    llm = world.llm(lora_backend="torch", max_loras=2)
    for name, (path, mention) in bad_adapters(world, str(tmp_path)).items():
        with pytest.raises(AdapterError) as refused:
            llm.add_adapter(name, path)
        assert mention in str(refused.value), f"{name}: {refused.value}"
        with pytest.raises(ValueError, match="not registered"):
            llm.generate(world.prompts[:1], GREEDY, adapters=[name])
    assert_matches_peft(world, llm.generate(world.prompts, GREEDY, adapters=REQUESTS),
                        "after refusals")


def test_replacing_an_adapter_serves_the_new_weights(world):
    """With another adapter in the batch, decode steps take the bag path and its cached
    tables: the refilled slot must be seen there too."""
    llm = world.llm(lora_backend="torch", max_loras=2)
    other = REQUESTS.index("attn-r1")
    prompts = [world.prompts[i] for i in (*QV, other)]
    adapters = ["qv-r16"] * len(QV) + ["attn-r1"]
    first = llm.generate(prompts, GREEDY, adapters=adapters)
    assert [o.token_ids for o in first] == [world.expected[i] for i in (*QV, other)]
    llm.add_adapter("qv-r16", world.replacement)  # same name, new weights, old copy in a slot
    again = llm.generate(prompts, GREEDY, adapters=adapters)
    assert [o.token_ids for o in again] == [*world.expected_replacement, world.expected[other]]
    assert world.expected_replacement != [world.expected[i] for i in QV], "no change to see"
    assert llm.engine.lora.residency("qv-r16") == "device"


def test_removed_adapter_cannot_be_used(world):
    llm = world.llm(lora_backend="torch", max_loras=2)
    llm.generate(world.prompts[:1], GREEDY, adapters=["qv-r16"])
    llm.remove_adapter("qv-r16")
    with pytest.raises(ValueError, match="'qv-r16' is not registered"):
        llm.generate(world.prompts[:1], GREEDY, adapters=["qv-r16"])
    assert "qv-r16" not in llm.engine.lora.resident()
    still = llm.generate(world.prompts[:2], GREEDY, adapters=REQUESTS[:2])
    assert [o.token_ids for o in still] == world.expected[:2], "other adapters after remove"


def test_unknown_adapter_queues_nothing(world):
    llm = world.llm(lora_backend="torch", max_loras=2)
    with pytest.raises(ValueError, match="not registered"):
        llm.generate(world.prompts[:2], GREEDY, adapters=[None, "no-such-adapter"])
    assert not llm.engine.has_unfinished()
