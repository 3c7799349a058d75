"""LoRA on embed_tokens and lm_head: mixed batches give exactly PEFT's greedy tokens.

Adapters saved by PEFT itself that adapt only embed_tokens, only lm_head, or both plus q/v
(with rank/alpha patterns on them), batched with ordinary adapters and base-model rows, on
an untied base and on one with tie_word_embeddings (where lm_head's LoRA is its own, or, with
ensure_weight_tying, the embedding LoRA transposed). The oracle is PEFT (tests/engine/
peft_reference.py), one greedy generate per request, float32 on CPU.
"""

import os

import torch

if not torch.cuda.is_available():  # before anything imports triton (kernels import it lazily)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from peft_reference import MAX_TOKENS, build_base, load_peft, peft_greedy, save_peft_adapters  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "embed-r4": dict(r=4, lora_alpha=8, target_modules=["embed_tokens"]),
    "head-r8": dict(r=8, lora_alpha=16, target_modules=["lm_head"]),
    "embed-head-qv": dict(r=16, lora_alpha=16, use_rslora=True,
                          target_modules=["embed_tokens", "lm_head", "q_proj", "v_proj"],
                          rank_pattern={"embed_tokens": 2}, alpha_pattern={"lm_head": 4}),
    "qv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all-r2": dict(r=2, lora_alpha=4, target_modules=ALL_SEVEN),
}
TIED_ADAPTERS = {
    "embed-head-q": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head", "q_proj"]),
    "head-r8": dict(r=8, lora_alpha=16, target_modules=["lm_head"]),
    "qv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
}
# PEFT's tied-adapter mode: lm_head's LoRA is embed_tokens' LoRA transposed (saved separately:
# ensure_weight_tying rewrites the config's targets).
WEIGHT_TYING = {"tied-embed-v": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "v_proj"],
                                     ensure_weight_tying=True)}
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
LENGTHS = (5, 1, 17, 9, 23, 3, 12, 7, 14, 2, 19, 6, 11, 8, 4, 10)


class World:
    """A base checkpoint, PEFT-saved adapters, mixed requests and PEFT's answers."""

    def __init__(self, root: str, specs: dict[str, dict], tied: bool = False,
                 separate: dict[str, dict] | None = None):
        self.base = build_base(os.path.join(root, "base"), tie_word_embeddings=tied)
        # Separately saved adapters load into the oracle first: PEFT ties an ensure_weight_tying
        # adapter's lm_head only while lm_head holds no other adapter's LoRA yet (loaded after
        # one, it gets no lm_head LoRA at all); alone, as from_pretrained serves it, it does.
        self.dirs = save_peft_adapters(self.base, os.path.join(root, "separate"), separate or {}, 2)
        self.dirs |= save_peft_adapters(self.base, os.path.join(root, "adapters"), specs, 1)
        names = list(self.dirs)
        # every adapter twice and the base model three times
        self.requests = [*names, None, *reversed(names), None, None]
        g = torch.Generator().manual_seed(7)
        self.prompts = [torch.randint(0, 256, (n,), generator=g).tolist()
                        for n in LENGTHS[:len(self.requests)]]
        oracle = load_peft(self.base, self.dirs)
        with torch.inference_mode():
            self.expected = peft_greedy(oracle, self.prompts, self.requests)
            base = peft_greedy(oracle, self.prompts, [None] * len(self.prompts))
        for want, plain, adapter in zip(self.expected, base, self.requests, strict=True):
            assert (want != plain) == (adapter is not None), f"adapter {adapter} changes nothing"

    def llm(self, **kwargs) -> LLM:
        options = dict(device="cpu", dtype="float32", max_loras=len(self.dirs), max_lora_rank=16)
        llm = LLM(self.base, **{**options, **kwargs})
        for name, path in self.dirs.items():
            llm.add_adapter(name, path)
        return llm

    def check(self, outputs, label: str) -> None:
        for i, (out, want) in enumerate(zip(outputs, self.expected, strict=True)):
            assert out.token_ids == want, (
                f"{label}: request {i} (adapter {self.requests[i]}, prompt of "
                f"{len(self.prompts[i])} tokens) gave {out.token_ids}, PEFT {want}")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return World(str(tmp_path_factory.mktemp("lora-embeddings")), ADAPTERS)


@pytest.fixture(scope="module")
def tied_world(tmp_path_factory) -> World:
    return World(str(tmp_path_factory.mktemp("lora-embeddings-tied")), TIED_ADAPTERS, tied=True,
                 separate=WEIGHT_TYING)


def needs_triton(engine: dict) -> None:
    if engine["lora_backend"] == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend runs on CPU only under TRITON_INTERPRET=1; "
                    "tests/kernels/test_kernels_gpu.py covers it on GPUs")


ENGINES = {
    "torch": dict(lora_backend="torch"),
    # chunked prefill: rows that do not sample share steps with rows that do
    "torch-2-slots-chunked": dict(lora_backend="torch", max_loras=2, max_num_batched_tokens=8),
    "triton": dict(lora_backend="triton"),
    "triton-2-slots-chunked": dict(lora_backend="triton", max_loras=2, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_mixed_batch_matches_peft(world, engine):
    needs_triton(ENGINES[engine])
    llm = world.llm(**ENGINES[engine])
    world.check(llm.generate(world.prompts, GREEDY, adapters=world.requests), engine)
    assert llm.engine.lora.slots_in_use == 0


@pytest.mark.parametrize("engine", ["torch-2-slots-chunked", "triton"])
def test_tied_embeddings_match_peft(tied_world, engine):
    """A tied base: lm_head LoRA over the shared weight, and PEFT's ensure_weight_tying mode."""
    needs_triton(ENGINES[engine])
    llm = tied_world.llm(**ENGINES[engine])
    tied_world.check(llm.generate(tied_world.prompts, GREEDY, adapters=tied_world.requests),
                     f"tied {engine}")


def test_each_request_alone_equals_batched(world):
    llm = world.llm(lora_backend="torch", max_loras=2)
    for i, (prompt, adapter) in enumerate(zip(world.prompts, world.requests, strict=True)):
        alone = llm.generate([prompt], GREEDY, adapters=[adapter])[0]
        assert alone.token_ids == world.expected[i], f"request {i} ({adapter}) alone"


def test_adapters_without_vocabulary_targets_cost_nothing(world, monkeypatch):
    """No vocabulary-sized buffers until an adapter needs them, and no embed_tokens / lm_head
    LoRA work in steps whose rows' adapters do not adapt them."""
    S, R, V, H = 2, 16, 256, 64
    llm = LLM(world.base, device="cpu", dtype="float32", max_loras=S, max_lora_rank=R,
              lora_backend="torch")
    lora = llm.engine.lora
    for name in ("qv-r8", "all-r2"):
        llm.add_adapter(name, world.dirs[name])
    assert lora.device_bytes["embed_tokens"] == lora.device_bytes["lm_head"] == 0
    assert lora.device_bytes["projections"] > 0

    steps = []
    prepare = lora.prepare
    monkeypatch.setattr(lora, "prepare", lambda batch: steps.append(prepare(batch)) or steps[-1])
    ordinary = [i for i, a in enumerate(world.requests) if a in ("qv-r8", "all-r2", None)]
    prompts = [world.prompts[i] for i in ordinary]
    adapters = [world.requests[i] for i in ordinary]
    want = [world.expected[i] for i in ordinary]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, adapters=adapters)] == want
    assert steps and all(not s.embed and s.sample is None for s in steps if s is not None)

    llm.add_adapter("embed-head-qv", world.dirs["embed-head-qv"])  # one slot each, like A and B
    assert lora.device_bytes["embed_tokens"] == S * R * (V + H) * 4 + S * 8
    assert lora.device_bytes["lm_head"] == S * R * (H + V) * 4 + S * 8
    steps.clear()
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, adapters=adapters)] == want
    assert all(not s.embed and s.sample is None for s in steps if s is not None)

    steps.clear()
    i = world.requests.index("embed-head-qv")
    mixed = llm.generate([world.prompts[i], prompts[0]], GREEDY,
                         adapters=["embed-head-qv", adapters[0]])
    assert [o.token_ids for o in mixed] == [world.expected[i], want[0]]
    assert steps and all(s.embed and s.sample is not None for s in steps)
