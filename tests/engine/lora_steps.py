"""The LoRAStep each step runs with, as the model runner builds it (engine/forward/lora.py), for
tests that check what a step's LoRA work is made of."""

from __future__ import annotations

from collections.abc import Callable


def watch_lora_steps(llm, monkeypatch, check: Callable[[], None] | None = None) -> list:
    """The LoRAStep of every step from now on (None for steps without adapters); `check()`
    runs before each step's forward."""
    runner, steps = llm.engine.model_runner, []
    prepare = runner.prepare

    def watched(plan, pending=None):
        inputs = prepare(plan, pending)
        if check is not None:
            check()
        steps.append(inputs.lora)
        return inputs

    monkeypatch.setattr(runner, "prepare", watched)
    return steps
