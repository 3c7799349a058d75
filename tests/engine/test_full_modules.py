"""Saved modules (PEFT modules_to_save on lm_head and embed_tokens): mixed batches give exactly
PEFT's greedy tokens, they are opt-in (--max-full-module-slots), adapters that have them wait
for a full-module slot like any LoRA slot, and their device copies are freed when they leave.

Adapters saved by PEFT itself: saved lm_head, saved embed_tokens, both (with LoRA on q/v), and a
LoRA on embed_tokens beside a saved lm_head, batched with ordinary LoRA adapters (q/v, lm_head,
embed_tokens) and base-model rows; on a tied base also PEFT's ensure_weight_tying, where both
ends share one saved copy. The oracle is PEFT (tests/engine/peft_reference.py), each adapter in
its own PeftModel as from_pretrained serves it (PEFT cannot hold a LoRA on lm_head beside
another adapter's saved lm_head), one greedy generate per request, float32 on CPU.
"""

import gc
import weakref

import pytest
import torch
from lora_steps import watch_lora_steps
from peft_reference import HIDDEN, MAX_TOKENS, VOCAB, World, needs_triton

from loragw.adapters.errors import AdapterError
from loragw.engine import LLM, SamplingParams
from loragw.engine.config import Config
from loragw.engine.llm_engine import LLMEngine

QV = ["q_proj", "v_proj"]
SAVED = {
    "saved-head-qv": dict(r=8, lora_alpha=16, target_modules=QV, modules_to_save=["lm_head"]),
    "saved-embed-qv": dict(r=4, lora_alpha=8, target_modules=QV, modules_to_save=["embed_tokens"]),
    "saved-both-qv": dict(r=4, lora_alpha=4, target_modules=QV,
                          modules_to_save=["model.embed_tokens", "lm_head"]),
    "embed-lora-saved-head": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "o_proj"],
                                  modules_to_save=["lm_head"]),
}
ORDINARY = {
    "qv-r8": dict(r=8, lora_alpha=16, target_modules=QV),
    "head-r8": dict(r=8, lora_alpha=16, target_modules=["lm_head"]),
    "embed-r4": dict(r=4, lora_alpha=8, target_modules=["embed_tokens"]),
}
TIED = {
    "saved-head-q": dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"]),
    "saved-embed-q": dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                          modules_to_save=["embed_tokens"]),
    "weight-tying-q": dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                           modules_to_save=["embed_tokens"], ensure_weight_tying=True),
    "head-r8": ORDINARY["head-r8"],
    "qv-r8": ORDINARY["qv-r8"],
}
V, H = VOCAB, HIDDEN  # the base's vocabulary and hidden size
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
FLAG = "--max-full-module-slots"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return World(str(tmp_path_factory.mktemp("full-modules")), SAVED | ORDINARY, apart=True,
                 prompt_seed=11)


@pytest.fixture(scope="module")
def tied_world(tmp_path_factory) -> World:
    return World(str(tmp_path_factory.mktemp("full-modules-tied")), TIED, tied=True,
                 apart=True, prompt_seed=11)


def watch_steps(llm: LLM, monkeypatch) -> list:
    """The LoRAStep of every step from now on (None for steps without adapters)."""
    full = llm.engine.lora.pool.full

    def check() -> None:
        assert len(full.held) <= full.capacity

    return watch_lora_steps(llm, monkeypatch, check)


ENGINES = {
    "torch": dict(),
    # one full-module slot for four adapters that need one, three LoRA slots, chunked prefill:
    # saved-module adapters wait their turn beside the others
    "torch-1-full-slot-chunked": dict(max_loras=3, max_full_module_slots=1,
                                      max_num_batched_tokens=8),
    "triton-2-full-slots": dict(lora_backend="triton", max_loras=4, max_full_module_slots=2,
                                max_num_batched_tokens=16),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_mixed_batch_matches_peft(world, engine, monkeypatch):
    needs_triton(ENGINES[engine])
    llm = world.llm(**ENGINES[engine])
    steps = watch_steps(llm, monkeypatch)
    world.check(llm.generate(world.prompts, GREEDY, adapters=world.requests), engine)
    lora = llm.engine.lora
    assert lora.slots_in_use == 0
    mixed = [s for s in steps if s is not None and s.full is not None]
    assert any(s.full.head and s.full.head_base_rows.numel() for s in mixed), (
        "no step mixed saved-lm_head rows with base-lm_head rows")
    assert any(s.full.embed and s.tokens.has_lora for s in mixed)
    if lora.pool.full.capacity < len(world.saved):
        assert lora.stats.device_evictions > 0, "saved-module adapters never had to wait"


def test_each_request_alone_equals_batched(world):
    llm = world.llm(max_loras=2, max_full_module_slots=1)
    for i, (prompt, adapter) in enumerate(zip(world.prompts, world.requests, strict=True)):
        alone = llm.generate([prompt], GREEDY, adapters=[adapter])[0]
        assert alone.token_ids == world.expected[i], f"request {i} ({adapter}) alone"


def test_tied_base_matches_peft(tied_world, monkeypatch):
    """On a tied base a saved lm_head or embed_tokens replaces only its own end; with
    ensure_weight_tying both ends are the one saved copy, held once on the device."""
    llm = tied_world.llm(max_loras=3, max_full_module_slots=2, max_num_batched_tokens=16)
    tied_world.check(llm.generate(tied_world.prompts, GREEDY, adapters=tied_world.requests),
                     "tied")
    lora = llm.engine.lora
    lora.evict("saved-head-q"), lora.evict("saved-embed-q")
    assert lora.to_device("weight-tying-q") == "device"
    (copies,) = lora.pool.full.held.values()
    assert copies["lm_head"] is copies["embed_tokens"]
    assert lora.device_bytes["full_modules"] == V * H * 4


def test_off_by_default_naming_the_flag(world):
    llm = LLM(world.base, device="cpu", dtype="float32", max_loras=2, lora_backend="torch")
    for name in world.saved:
        with pytest.raises(AdapterError, match=FLAG) as refused:
            llm.add_adapter(name, world.dirs[name])
        assert refused.value.status == 422 and "modules_to_save" in str(refused.value)
    llm.add_adapter("qv-r8", world.dirs["qv-r8"])  # the engine keeps serving the others
    i = world.requests.index("qv-r8")
    assert llm.generate([world.prompts[i]], GREEDY, ["qv-r8"])[0].token_ids == world.expected[i]
    with pytest.raises(ValueError, match=r"max_full_module_slots must be in \[0, max_loras=2\]"):
        Config(world.base, max_loras=2, max_full_module_slots=3)


def test_memory_is_accounted_and_released(world, monkeypatch):
    llm = world.llm(max_loras=4, max_full_module_slots=1)  # room for the ordinary ones beside
    lora = llm.engine.lora
    ordinary = [i for i, a in enumerate(world.requests) if a in (*ORDINARY, None)]
    run = lambda rows: llm.generate([world.prompts[i] for i in rows], GREEDY,  # noqa: E731
                                    adapters=[world.requests[i] for i in rows])
    steps = watch_steps(llm, monkeypatch)
    assert [o.token_ids for o in run(ordinary)] == [world.expected[i] for i in ordinary]
    assert lora.device_bytes["full_modules"] == 0 and not lora.pool.full.held
    assert all(s.full is None for s in steps if s is not None), "ordinary rows paid for saved ones"

    both = [i for i, a in enumerate(world.requests) if a == "saved-both-qv"]
    assert [o.token_ids for o in run(both)] == [world.expected[i] for i in both]
    assert lora.device_bytes["full_modules"] == 2 * V * H * 4  # its lm_head and embed_tokens
    steps.clear()  # a saved-module adapter resident but not in the batch costs nothing either
    assert [o.token_ids for o in run(ordinary)] == [world.expected[i] for i in ordinary]
    assert all(s.full is None for s in steps if s is not None)
    assert lora.residency("saved-both-qv") == "device"
    monkeypatch.undo()  # the recorded steps hold the copies too
    steps.clear()

    def device_refs():
        return [weakref.ref(t) for copies in lora.pool.full.held.values() for t in copies.values()]

    refs = device_refs()
    assert refs and lora.evict("saved-both-qv")
    gc.collect()
    assert all(ref() is None for ref in refs), "evicted saved modules still referenced"
    assert lora.device_bytes["full_modules"] == 0 and lora.residency("saved-both-qv") == "disk"

    assert [o.token_ids for o in run(both)] == [world.expected[i] for i in both]  # reloads
    refs = device_refs()
    host = [weakref.ref(t) for t in lora.adapters["saved-both-qv"].host.saved_modules.values()]
    llm.remove_adapter("saved-both-qv")
    gc.collect()
    assert all(ref() is None for ref in refs + host), "removed saved modules still referenced"
    assert lora.device_bytes["full_modules"] == 0


def test_rows_use_their_own_adapters_copy():
    """FullModuleSlots and LoRAStep.build against the one-line meaning, row by row: a token of an adapter with a
    saved embed_tokens takes its row of that copy, a sampling row of an adapter with a saved
    lm_head its logits from that copy, every other row the base's."""
    from loragw.engine.forward.lora import LoRARows, LoRAStep, embed_full_rows, head_logits
    from loragw.engine.lora.full_modules import FullModuleSlots

    def full_step(token_slots: list[int], sample_slots: list[int]):
        rows = LoRARows(token_slots, sample_slots, 4, embed=False, head=False, experts=False,
                        full=slots.held)
        return LoRAStep.build(rows, torch.device("cpu")).full

    g = torch.Generator().manual_seed(0)
    base, embed_b = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    head_a = torch.randn(V, H, generator=g).bfloat16()  # saved in bf16, served in float32
    slots = FullModuleSlots(2, torch.device("cpu"), torch.float32)
    slots.fill(0, {"lm_head": head_a})
    slots.fill(3, {"embed_tokens": embed_b, "lm_head": embed_b})  # tied by PEFT: one copy
    assert slots.num_bytes == 2 * V * H * 4 and not slots.has_free
    token_slots, sample_slots = [0, 3, -1, 3, 1, 0], [3, -1, 0, 0, 1]
    step = full_step(token_slots, sample_slots)
    ids = torch.randint(0, V, (len(token_slots),), generator=g)
    y = base[ids].clone()
    embed_full_rows(y, ids, step)
    assert torch.equal(y, torch.stack([embed_b[i] if s == 3 else base[i]
                                       for i, s in zip(ids, token_slots, strict=True)]))
    hidden = torch.randn(len(sample_slots), H, generator=g)
    heads = {0: head_a.float(), 3: embed_b}
    want = torch.stack([hidden[b] @ heads.get(s, base).T for b, s in enumerate(sample_slots)])
    torch.testing.assert_close(head_logits(hidden, base, step), want)
    assert full_step([1, -1, 1], [1]) is None  # no row of an adapter with a saved module
    slots.clear(3)
    assert slots.num_bytes == V * H * 4 and slots.has_free


def test_pinning_keeps_a_full_module_slot_free(world):
    llm = world.llm(max_loras=4, max_full_module_slots=2)
    llm.engine.pin_adapter("saved-head-qv")
    with pytest.raises(AdapterError, match=f"raise {FLAG}"):
        llm.engine.pin_adapter("saved-embed-qv")
    llm.engine.pin_adapter("qv-r8")  # ordinary adapters still pin up to --max-loras - 1


AGING_STEPS = 4


def test_aging_frees_a_full_module_slot_for_a_starving_adapter(world):
    """A stream of requests keeps the only full-module slot busy while LoRA slots stand free;
    a request for another saved-module adapter still runs within the aging bound."""
    engine = LLMEngine(Config(world.base, device="cpu", dtype="float32", max_loras=3,
                              max_full_module_slots=1, lora_backend="torch",
                              lora_starvation_steps=AGING_STEPS))
    for name in ("saved-head-qv", "saved-embed-qv"):
        engine.add_adapter(name, world.dirs[name])
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request(world.prompts[0], params, adapter="saved-head-qv")
    engine.step()
    waiting = engine.add_request(world.prompts[1], params, adapter="saved-embed-qv")
    finished_at = None
    for step in range(60):
        if step < 40:
            engine.add_request(world.prompts[step % 4], params, adapter="saved-head-qv")
        for out in engine.step():
            if out.request_id == waiting and out.finished:
                finished_at = step
    assert finished_at is not None and finished_at <= AGING_STEPS + 4 + 4, finished_at
    while engine.has_unfinished():
        engine.step()
    assert engine.lora.slots_in_use == 0
