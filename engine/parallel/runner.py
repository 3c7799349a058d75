"""Rank 0 of a tensor-parallel engine and the workers it drives (`--tensor-parallel-size N`).

The engine (scheduler, block manager, LoRA manager, sampler) lives on rank 0 only. Ranks
1..N-1 are worker processes holding their part of every layer, their own KV cache (their KV
heads) and their part of every adapter slot. Rank 0 tells them, in one control message each
(group.broadcast, a gloo collective), everything that touches their state, in its order:
    Run(plan)                      a step: the StepPlan rank 0's own ModelRunner.prepare reads
                                   (engine/sched/plan.py); every rank runs the same forward and
                                   only rank 0's logits are sampled
    SlotChange(op, args, table)    a slot-pool reserve / fill / clear that rank 0 has applied
                                   (RankSink, the pool's replicas); the worker applies it and
                                   checks its slot table equals rank 0's
    None                           stop
so the ranks never decide anything. A rank that dies fails the next collective (gloo sees the
connection close; otherwise the group's timeout, TIMEOUT_S); rank 0 then raises RankLost, which
ends the engine loop, and the server with it.

torch.distributed has one default group per process, so one tensor-parallel engine runs in a
process at a time: starting a second closes the first (`close`, also what a dropped engine's
finalizer does), which then refuses to run.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing
import os
import tempfile
import weakref
from dataclasses import dataclass

from loragw.adapters.format import LoraAdapter
from loragw.engine.config import Config
from loragw.engine.distributed import group
from loragw.engine.distributed.shard import Shard
from loragw.engine.lora.pool import SlotPool
from loragw.engine.runner.model_runner import ModelRunner, StepLogits
from loragw.engine.runner.step_runner import Runner
from loragw.engine.sched.plan import StepPlan

logger = logging.getLogger(__name__)

TIMEOUT_S = 120.0  # every collective; a dead rank fails the step after this long
_active: weakref.ref | None = None  # this process's running ParallelRunner, if any


class RankLost(RuntimeError):
    """A tensor-parallel rank is gone: no step can run again, so the engine must stop."""


@dataclass(frozen=True, slots=True)
class Run:
    plan: StepPlan


@dataclass(frozen=True, slots=True)
class SlotChange:
    op: str  # "reserve" | "fill" | "clear": SlotSink's methods
    args: tuple
    table: dict  # rank 0's SlotPool.table() after the change


def worker_main(config: Config, rank: int, init_method: str) -> None:
    """Rank `rank`: join the group, build this rank's part, apply rank 0's messages."""
    shard = Shard(rank, config.tensor_parallel_size)
    group.init(shard, init_method, config.torch_device, TIMEOUT_S)
    (num_kv_blocks,) = group.broadcast()
    runner = ModelRunner(dataclasses.replace(config, num_kv_blocks=num_kv_blocks), shard)
    pool = SlotPool(runner.model, config.max_loras, config.max_lora_rank, runner.device,
                    runner.dtype, config.max_full_module_slots)  # as LoRAManager builds rank 0's
    while (message := group.broadcast()) is not None:
        if isinstance(message, Run):
            runner.run(message.plan)
        else:
            getattr(pool, message.op)(*message.args)
            table = pool.table()
            assert table == message.table, (f"rank {rank}'s adapter slots differ from rank 0's "
                                            f"after {message.op}: {table} != {message.table}")
    group.destroy()


class RankSink:
    """The slot pool's replicas under tensor parallelism: each change rank 0's pool made, sent
    to every worker rank (SlotPool's `replicas`)."""

    def __init__(self, runner: ParallelRunner):
        self.runner = runner

    def reserve(self, adapter: LoraAdapter, table: dict) -> None:
        self.runner.send(SlotChange("reserve", (adapter,), table))

    def fill(self, index: int, adapter: LoraAdapter, table: dict) -> None:
        self.runner.send(SlotChange("fill", (index, adapter), table))

    def clear(self, index: int, table: dict) -> None:
        self.runner.send(SlotChange("clear", (index,), table))


def start_runner(config: Config) -> tuple[Runner, ModelRunner, RankSink | None]:
    """(what runs the engine's steps, this process's ModelRunner, the slot pool's replicas):
    the ModelRunner itself on one rank; rank 0's ParallelRunner, its own ModelRunner and the
    sink that sends every slot change to the other ranks (in the order rank 0 makes them)."""
    if config.tensor_parallel_size == 1:
        runner = ModelRunner(config)
        return runner, runner, None
    parallel = ParallelRunner(config)  # spawns the other ranks
    return parallel, parallel.model_runner, parallel.sink


class ParallelRunner:
    """Rank 0's runner for N > 1 ranks: its own ModelRunner (`model_runner`), and the workers,
    which every step and slot change is sent to first."""

    def __init__(self, config: Config):
        global _active
        gc.collect()  # a dropped engine's finalizer stops its workers and leaves the group
        previous = _active() if _active is not None else None
        if previous is not None:
            logger.warning("closing this process's previous tensor-parallel engine: "
                           "torch.distributed holds one default group per process")
            previous.close()
        size = config.tensor_parallel_size
        handle, path = tempfile.mkstemp(prefix="loragw-tp-")
        os.close(handle)
        os.unlink(path)  # init_method file:// wants a path that does not exist yet
        init_method = f"file://{path}"
        ctx = multiprocessing.get_context("spawn")
        self.workers = [ctx.Process(target=worker_main, args=(config, rank, init_method),
                                    name=f"loragw-tp-rank{rank}", daemon=True)
                        for rank in range(1, size)]
        for worker in self.workers:
            worker.start()
        try:
            group.init(Shard(0, size), init_method, config.torch_device, TIMEOUT_S)
            self.model_runner = ModelRunner(config, Shard(0, size))
            group.broadcast((self.model_runner.num_kv_blocks,))
        except BaseException:  # e.g. a shape the ranks cannot split: leave nothing behind
            for worker in self.workers:
                worker.kill()
            group.destroy()
            raise
        self.sink = RankSink(self)
        self.closed = False
        self._finalizer = weakref.finalize(self, _stop, self.workers)
        _active = weakref.ref(self)
        logger.info("tensor parallel: %d ranks, %d worker processes", size, len(self.workers))

    def run(self, plan: StepPlan, pending: None = None) -> StepLogits:
        assert plan.lora is None or plan.lora.full is None, "saved modules under TP are refused"
        assert pending is None, "async scheduling under TP is refused"
        self.send(Run(plan))
        try:
            return self.model_runner.run(plan)
        except Exception as exc:
            self.check_ranks(exc)
            raise

    def send(self, message: Run | SlotChange) -> None:
        if self.closed:
            raise RuntimeError("this tensor-parallel engine is closed (another one may have "
                               "started in this process since)")
        try:
            group.broadcast(message)
        except Exception as exc:
            self.check_ranks(exc)
            raise

    def check_ranks(self, exc: Exception | None = None) -> None:
        """Raise RankLost if a worker has exited (a failed collective usually means one has)."""
        for rank, worker in enumerate(self.workers, start=1):
            worker.join(timeout=0.5 if exc is not None else 0)
            if not worker.is_alive():
                raise RankLost(f"tensor-parallel rank {rank} exited (exit code "
                               f"{worker.exitcode}): the model cannot run without it") from exc

    def close(self) -> None:
        """Stop the workers, leave the group and drop rank 0's model (idempotent)."""
        if not self.closed:
            self.closed = True
            self._finalizer()
            self.model_runner.close()


def _stop(workers) -> None:
    try:
        group.broadcast(None)
    except Exception:  # a dead rank: nothing to tell
        pass
    for worker in workers:
        worker.join(timeout=10)
        if worker.is_alive():
            worker.kill()
    group.destroy()
