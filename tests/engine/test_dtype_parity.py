"""bfloat16 and float16 serving matches transformers + PEFT run in the same dtype, with mixed
batches of several adapters and base-model rows.

Two PEFT worlds (tests/engine/peft_reference.py): the session's lora_world (six adapters,
ranks 1 to 16, attention-only to all seven targets, rslora, rank/alpha patterns,
layers_to_transform) and a small one whose adapters touch the vocabulary ends (LoRA on
embed_tokens and lm_head, and saved copies of both: modules_to_save). Every request of a world
goes to the engine at once, greedy, with logprobs; then PEFT, its base model loaded in the same
dtype, gives its logits behind every generated token in one teacher-forced forward per request
(World.peft_logits), so every position is compared on the same prefix, even after a near-tie.

What must hold, per generated token:
  logprobs   the engine's logprob of its token and of its top alternatives are PEFT's
             log_softmax at those tokens within TOL[dtype];
  tokens     the engine's token is PEFT's argmax, except at a near-tie: PEFT's logit of the
             engine's token is within TOL[dtype] of its largest. Near-ties are recorded (logged
             and in the junit properties) and must stay rare (MAX_NEAR_TIE_SHARE).

TOL[dtype] = EPS_TOL[dtype] * eps(dtype), in logits / logprobs: bfloat16 40 eps = 0.31,
float16 64 eps = 0.0625. Both sides round every activation to the dtype (eps: bf16 2^-7, fp16
2^-10) through two decoder layers, and the logits (|logit| up to ~5 here) are themselves
rounded to it, so each side sits tens of eps away from the float32 result, independently, by
amounts that depend on the CPU's kernels; measured max |engine - PEFT| logprob differences
(top alternatives included): on an AMD EPYC (AVX-512, avx512_bf16) bfloat16 0.15, float16
0.016; on an Intel Xeon with AMX and avx512_fp16, vocabulary-ends world, bfloat16 0.27,
float16 0.047 (48 eps). A dtype bug (a tensor kept in the wrong dtype, a LoRA delta lost to
rounding, a saved module cast twice) moves logits by far more than that.

Allowed differences, covered by TOL: the engine keeps LoRA weights in the serving dtype and
runs the LoRA math in float32 (kernels/reference.py), adding the delta to the base output
after rounding it to the dtype; PEFT keeps LoRA weights in float32 (autocast_adapter_dtype)
and adds the float32 delta before one rounding (with autocast off it would compute
lora_B(lora_A(dropout(x))) * scaling in the dtype). The engine's attention reads a paged KV
cache in decode steps; PEFT attends over the whole sequence at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch
from peft_reference import MAX_TOKENS, World

from loragw.engine import SamplingParams
from loragw.kernels import cpu_fused, cpu_lora

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
EPS_TOL = {torch.bfloat16: 40, torch.float16: 64}
TOL = {dtype: EPS_TOL[dtype] * torch.finfo(dtype).eps for dtype in DTYPES.values()}
MAX_NEAR_TIE_SHARE = 0.05  # of all generated tokens: 3 of 150 are near-ties in bf16 today
TOP = 5  # alternatives compared per token
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)
QV = ["q_proj", "v_proj"]
# PEFT cannot hold a LoRA on lm_head beside another adapter's saved lm_head: World(apart=True).
VOCAB_ENDS = {
    "embed-head-qv": dict(r=16, lora_alpha=16, use_rslora=True,
                          target_modules=["embed_tokens", "lm_head", *QV],
                          rank_pattern={"embed_tokens": 2}, alpha_pattern={"lm_head": 4}),
    "saved-both-qv": dict(r=4, lora_alpha=4, target_modules=QV,
                          modules_to_save=["model.embed_tokens", "lm_head"]),
}


@pytest.fixture(scope="module")
def vocab_world(tmp_path_factory) -> World:
    return World(str(tmp_path_factory.mktemp("dtype-vocab-ends")), VOCAB_ENDS, apart=True,
                 prompt_seed=13)


@dataclass(frozen=True)
class NearTie:
    """A token where the engine and PEFT chose differently, both within TOL of PEFT's best."""

    request: int
    position: int  # in the generated tokens
    engine_token: int
    peft_token: int
    gap: float  # PEFT's logit of its token minus that of the engine's


def compare(world: World, outputs, logits: list[torch.Tensor], tol: float,
            label: str) -> tuple[float, list[NearTie]]:
    """Assert the engine's `outputs` against PEFT's `logits` (World.peft_logits) as the module
    docstring says; returns the largest logprob difference seen and the near-ties."""
    worst, ties = 0.0, []
    for i, (out, want) in enumerate(zip(outputs, logits, strict=True)):
        where = f"{label}: request {i} (adapter {world.requests[i]})"
        assert len(out.token_ids) == len(out.logprobs) == MAX_TOKENS, where
        raw = torch.log_softmax(want, dim=-1)  # [N, V]
        for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            for t, logprob in [(token, entry.logprob), *entry.top]:
                diff = abs(logprob - raw[j, t].item())
                worst = max(worst, diff)
                assert diff <= tol, (f"{where}, token {j}: logprob of {t} is {logprob:.4f}, "
                                     f"PEFT {raw[j, t].item():.4f} (tolerance {tol:.3f})")
            best = int(want[j].argmax())
            if token != best:
                gap = (want[j, best] - want[j, token]).item()
                assert gap < tol, (f"{where}, token {j}: the engine chose {token}, PEFT {best} "
                                   f"by a logit margin of {gap:.4f} >= {tol:.3f}: not a near-tie")
                ties.append(NearTie(i, j, token, best, gap))
    return worst, ties


ON_GPU = dict(device="cuda", lora_backend="triton", attention_backend="triton")
GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("where", [pytest.param("cpu"), pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("world_name", ["mixed", "vocab-ends"])
def test_mixed_batch_matches_peft_in_the_same_dtype(request, record_property, world_name,
                                                    dtype_name, where, monkeypatch):
    """On the CPU (bfloat16 on its C kernels: decode attention, norms and rotary, the decode
    LoRA bags; float16 on torch's paths) and, on a GPU machine, with the Triton kernels and
    CUDA graphs against PEFT on the same GPU."""
    world: World = request.getfixturevalue("lora_world" if world_name == "mixed"
                                           else "vocab_world")
    dtype, label = DTYPES[dtype_name], f"{world_name}/{dtype_name}/{where}"
    llm = world.llm(dtype=dtype_name, **(ON_GPU if where == "cuda" else {}))
    assert {p.dtype for p in llm.engine.runner.model.parameters()} == {dtype}
    bags = []  # the C LoRA kernel's calls (kernels/cpu_lora.py)
    apply_bags = cpu_lora.apply_bags
    monkeypatch.setattr(cpu_lora, "apply_bags", lambda *args: bags.append(1) or apply_bags(*args))
    outputs = llm.generate(world.prompts, PARAMS, adapters=world.requests)
    if where == "cpu":
        backends, c = llm.engine.runner.backends, dtype in cpu_fused.DTYPES
        logger.info("%s: decode attention on %s, norms and rotary on %s, %d C LoRA calls", label,
                    backends.attention, backends.elementwise, len(bags))
        assert (backends.attention, backends.elementwise) == (("cpu",) * 2 if c else ("torch",) * 2)
        assert bool(bags) == c
    logits = world.peft_logits([out.token_ids for out in outputs], dtype, where)
    worst, ties = compare(world, outputs, logits, TOL[dtype], label)
    record_property("max_logprob_diff", round(worst, 5))
    record_property("near_ties", [vars(tie) for tie in ties])
    logger.info("%s: max |logprob - PEFT's| %.4f (tolerance %.3f); %d near-ties: %s", label,
                worst, TOL[dtype], len(ties), ties)
    total = sum(len(out.token_ids) for out in outputs)
    assert len(ties) <= MAX_NEAR_TIE_SHARE * total, (
        f"{label}: {len(ties)} of {total} tokens are near-ties: {ties}")
    assert llm.engine.num_free_kv_blocks == llm.engine.block_manager.num_blocks
