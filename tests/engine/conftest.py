"""Fixtures of the engine's tests: the Triton kernels through the interpreter on machines
without CUDA, and the PEFT world that test_lora_parity and test_prefix_cache share.

TRITON_INTERPRET must be set before kernels.lora_triton is imported (@triton.jit reads it when
it decorates); kernels import that module lazily, on the first backend="triton" call. On a CUDA
machine the variable is left alone.
"""

import os

import pytest
import torch
from peft_reference import ALL_SEVEN, Retrained, World
from small_world import checkpoint  # noqa: F401  (the scheduling tests' world)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Ranks 1 to 16; attention-only, MLP-only and all seven targets; rslora; rank/alpha patterns;
# layers_to_transform.
MIXED_ADAPTERS = {
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


@pytest.fixture(scope="session")
def lora_world(tmp_path_factory) -> World:
    """An untied base and MIXED_ADAPTERS, all saved by one PEFT model and answered by one."""
    world = World(str(tmp_path_factory.mktemp("lora-parity")), MIXED_ADAPTERS)
    assert len({tuple(e) for e in world.expected}) > len(world.requests) // 2, (
        "degenerate checkpoint")
    return world


@pytest.fixture(scope="session")
def qv_replacement(lora_world) -> Retrained:
    """qv-r16's config with other weights: what replacing qv-r16 must switch to."""
    return lora_world.retrain("qv-r16", seed=2)


@pytest.fixture
def every_draft(monkeypatch):
    """Every candidate row drafts as many tokens as its proposer gives (up to
    num_speculative_tokens), whatever the goodput model would choose: for tests of what
    verification keeps, on test models whose drafts would rarely pay. The choice itself is
    tested in test_spec_goodput.py."""
    from loragw.engine.spec import speculator

    monkeypatch.setattr(speculator, "choose_lengths",
                        lambda alphas, caps, rows, costs, forced=None: list(caps))
