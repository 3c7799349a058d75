"""Mixed-adapter batches give exactly PEFT's greedy tokens, and bad adapters are refused.

One tiny random Llama and six PEFT adapters (ranks 1 to 16; attention-only, MLP-only and all
seven targets; rslora; rank/alpha patterns; layers_to_transform), saved by PEFT itself: the
lora_world of tests/engine/conftest.py. The oracle is PeftModel with every adapter loaded, one
greedy generate per request (float32, CPU).
"""

import json
import os

import pytest
import safetensors.torch
import torch
from peft_reference import MAX_TOKENS, World, needs_triton, save_peft_adapters

from loragw.adapters.errors import AdapterError
from loragw.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

ENGINES = {
    "torch": dict(lora_backend="torch"),
    "torch-2-slots": dict(lora_backend="torch", max_loras=2),
    "torch-chunked-prefill": dict(lora_backend="torch", max_loras=3, max_num_batched_tokens=8),
    # every projection through oneDNN's packed GEMM (auto packs only large ones)
    "torch-onednn": dict(lora_backend="torch", linear_backend="onednn"),
    "triton": dict(lora_backend="triton"),
    "triton-2-slots-chunked": dict(lora_backend="triton", max_loras=2, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_mixed_batch_matches_peft(lora_world, engine):
    needs_triton(ENGINES[engine])
    llm = lora_world.llm(**ENGINES[engine])
    lora_world.check(llm.generate(lora_world.prompts, GREEDY, adapters=lora_world.requests), engine)
    assert llm.engine.num_free_kv_blocks == llm.engine.block_manager.num_blocks
    assert llm.engine.lora.slots_in_use == 0


def test_each_request_alone_equals_batched(lora_world):
    """Alone, each request gives PEFT's tokens too, so batching never changes an output."""
    llm = lora_world.llm(lora_backend="torch", max_loras=2)
    for i, (prompt, adapter) in enumerate(zip(lora_world.prompts, lora_world.requests,
                                              strict=True)):
        alone = llm.generate([prompt], GREEDY, adapters=[adapter])[0]
        assert alone.token_ids == lora_world.expected[i], f"request {i} ({adapter}) alone"


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


def test_bad_adapters_are_refused_and_the_engine_keeps_serving(lora_world, tmp_path):
    llm = lora_world.llm(lora_backend="torch", max_loras=2)
    for name, (path, mention) in bad_adapters(lora_world, str(tmp_path)).items():
        with pytest.raises(AdapterError) as refused:
            llm.add_adapter(name, path)
        assert mention in str(refused.value), f"{name}: {refused.value}"
        with pytest.raises(ValueError, match="not registered"):
            llm.generate(lora_world.prompts[:1], GREEDY, adapters=[name])
    lora_world.check(llm.generate(lora_world.prompts, GREEDY, adapters=lora_world.requests),
                     "after refusals")


def test_replacing_an_adapter_serves_the_new_weights(lora_world, qv_replacement):
    """With another adapter in the batch, decode steps take the bag path and its cached
    tables: the refilled slot must be seen there too."""
    llm = lora_world.llm(lora_backend="torch", max_loras=2)
    qv = lora_world.rows("qv-r16")
    other = lora_world.requests.index("attn-r1")
    prompts = [lora_world.prompts[i] for i in (*qv, other)]
    adapters = ["qv-r16"] * len(qv) + ["attn-r1"]
    first = llm.generate(prompts, GREEDY, adapters=adapters)
    assert [o.token_ids for o in first] == [lora_world.expected[i] for i in (*qv, other)]
    llm.add_adapter("qv-r16", qv_replacement.path)  # same name, new weights, old copy in a slot
    again = llm.generate(prompts, GREEDY, adapters=adapters)
    assert [o.token_ids for o in again] == [*qv_replacement.expected, lora_world.expected[other]]
    assert qv_replacement.expected != [lora_world.expected[i] for i in qv], "no change to see"
    assert llm.engine.lora.residency("qv-r16") == "device"


def test_a_sequence_keeps_the_version_it_started_on(lora_world, qv_replacement):
    """qv-r16 replaced mid-answer, then the answer preempted and admitted again: every token is
    still the old version's (PEFT's), while a request queued after the replace gets the new
    one; once the old answer ends, its retired weights are let go."""
    llm = lora_world.llm(lora_backend="torch", max_loras=2)
    engine, (row, *_) = llm.engine, lora_world.rows("qv-r16")
    old = engine.add_request(lora_world.prompts[row], GREEDY, "qv-r16")
    outputs: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)

    for _ in range(3):
        step()
    engine.add_adapter("qv-r16", qv_replacement.path)
    new = engine.add_request(lora_world.prompts[row], GREEDY, "qv-r16")
    step()
    (seq,) = [r.seq for r in engine.requests.values() if r.seq.request_id == old]
    engine.scheduler.running.remove(seq)  # preempted as the scheduler does when out of blocks:
    engine.scheduler._preempt(seq)  # back to waiting, to recompute on its own version
    while engine.has_unfinished():
        step()
    assert outputs[old] == lora_world.expected[row]
    assert outputs[new] == qv_replacement.expected[0] != lora_world.expected[row]
    assert not engine.lora.started.retired and not engine.lora.started.started


def test_removed_adapter_cannot_be_used(lora_world):
    llm = lora_world.llm(lora_backend="torch", max_loras=2)
    llm.generate(lora_world.prompts[:1], GREEDY, adapters=["qv-r16"])
    llm.remove_adapter("qv-r16")
    with pytest.raises(ValueError, match="'qv-r16' is not registered"):
        llm.generate(lora_world.prompts[:1], GREEDY, adapters=["qv-r16"])
    assert "qv-r16" not in llm.engine.lora.resident()
    still = llm.generate(lora_world.prompts[:2], GREEDY, adapters=lora_world.requests[:2])
    assert [o.token_ids for o in still] == lora_world.expected[:2], "other adapters after remove"


def test_unknown_adapter_queues_nothing(lora_world):
    llm = lora_world.llm(lora_backend="torch", max_loras=2)
    with pytest.raises(ValueError, match="not registered"):
        llm.generate(lora_world.prompts[:2], GREEDY, adapters=[None, "no-such-adapter"])
    assert not llm.engine.has_unfinished()
