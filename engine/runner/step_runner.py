"""What runs a step's forward pass for the engine: this process's ModelRunner, or under tensor
parallelism rank 0's ParallelRunner (engine/parallel/runner.py), which sends the step to the
other ranks and runs it on its own ModelRunner. The engine holds one of them as its Runner and
the ModelRunner of this process beside it (the model, the KV cache, the backends)."""

from __future__ import annotations

from typing import Protocol

from loragw.engine.runner.model_runner import StepLogits
from loragw.engine.sched.pipeline import PendingInputs
from loragw.engine.sched.plan import StepPlan


class Runner(Protocol):
    def run(self, plan: StepPlan, pending: PendingInputs | None = None) -> StepLogits:
        """The step's logits rows (engine/runner/model_runner.py ModelRunner.run)."""

    def close(self) -> None:
        """Free the model and the KV cache (and stop the other ranks); idempotent."""
