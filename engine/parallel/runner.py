"""Rank 0 of a tensor-parallel engine and the workers it drives.

The engine (scheduler, block manager, LoRA manager, sampler) lives on rank 0 only. Ranks
1..N-1 are worker processes holding their part of every layer, their own KV cache (their KV
heads) and their part of every adapter slot. Before anything that touches a rank's state, rank
0 broadcasts it in one control message (group.broadcast, a gloo collective):
    ("run", rows, lora)      a step: what ModelRunner.prepare reads of each row (`Row`), the
                             logit rows, and the LoRA step's slots; every rank then runs the
                             same forward, and only rank 0's logits are sampled
    ("reserve" | "fill" | "clear", ...)   the slot pool calls, in rank 0's order
    ("stop",)
so the ranks never decide anything: they apply rank 0's decisions in its order. A rank that
dies fails the next collective (gloo sees the connection close; otherwise the group's timeout,
TIMEOUT_S); rank 0 then raises RankLost, which stops the engine process, and the server with it.
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

from engine.config import Config
from engine.forward_context import LoRAStep
from engine.model_runner import ModelRunner
from engine.parallel import group
from engine.parallel.shard import Shard
from engine.scheduler import LogitRows, ScheduledBatch
from kernels import make_lora_meta

logger = logging.getLogger(__name__)

TIMEOUT_S = 120.0  # every collective; a dead rank fails the step after this long
_active = None  # weakref to this process's ParallelRunner, if one runs


class RankLost(RuntimeError):
    """A tensor-parallel rank is gone: no step can run again, so the engine must stop."""


class _Tail:
    """The last tokens of a sequence, indexed by absolute position (Sequence.token_ids)."""

    __slots__ = ("start", "ids")

    def __init__(self, start: int, ids: list[int]):
        self.start, self.ids = start, ids

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self.ids[key.start - self.start:key.stop - self.start]
        return self.ids[key - self.start]


@dataclass(slots=True)
class Row:
    """What ModelRunner.prepare reads of one scheduled sequence."""

    num_computed_tokens: int
    block_table: list[int]
    token_ids: _Tail


def _rows(batch: ScheduledBatch) -> ScheduledBatch:
    """`batch` with each Sequence cut down to its Row (pickled at once by the broadcast, so
    nothing is copied here), its logit rows found once on rank 0."""
    rows = [Row(seq.num_computed_tokens, seq.block_table,
                _Tail(seq.num_computed_tokens,
                      seq.token_ids[seq.num_computed_tokens:seq.num_computed_tokens + n]))
            for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]
    return ScheduledBatch(rows, batch.num_new_tokens, batch.num_decode, batch.logit_rows)


def _lora(lora: LoRAStep | None):
    if lora is None:
        return None
    assert lora.full is None, "saved modules are refused under tensor parallelism"
    return lora.token_slots, lora.num_slots, lora.embed, lora.sample is not None


def _lora_step(wire, logit_rows: LogitRows, device) -> LoRAStep | None:
    if wire is None:
        return None
    token_slots, num_slots, embed, has_sample = wire
    sample = (make_lora_meta([token_slots[r] for r in logit_rows.rows], num_slots, device=device)
              if has_sample else None)
    return LoRAStep(token_slots, num_slots, embed=embed, sample=sample)


def worker_main(config: Config, rank: int, init_method: str) -> None:
    """Rank `rank`: join the group, build this rank's part, apply rank 0's messages."""
    from engine.lora_pool import SlotPool

    shard = Shard(rank, config.tensor_parallel_size)
    group.init(shard, init_method, config.torch_device, TIMEOUT_S)
    (num_kv_blocks,) = group.broadcast()
    runner = ModelRunner(dataclasses.replace(config, num_kv_blocks=num_kv_blocks), shard)
    # as LoRAManager builds rank 0's
    pool = SlotPool(runner.model, config.max_loras, config.max_lora_rank, runner.device,
                    runner.dtype, config.max_full_module_slots)
    while True:
        op, *args = group.broadcast()
        if op == "run":
            batch, lora = args
            runner.run(batch, _lora_step(lora, batch.logit_rows, runner.device))
        elif op == "tables":
            group.gather(slot_table(pool))
        elif op == "stop":
            break
        else:
            getattr(pool, op)(*args)
    group.destroy()


class ParallelRunner:
    """ModelRunner's interface on rank 0, for --tensor-parallel-size N > 1."""

    def __init__(self, config: Config):
        global _active
        gc.collect()  # a dropped engine's finalizer stops its workers and leaves the group
        if _active is not None and _active() is not None:
            raise RuntimeError("a tensor-parallel engine is already running in this process "
                               "(torch.distributed has one default group): close it first "
                               "(llm.engine.runner.close())")
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
            self.local = ModelRunner(config, Shard(0, size))
            group.broadcast((self.local.num_kv_blocks,))
        except BaseException:  # e.g. a shape the ranks cannot split: leave nothing behind
            for worker in self.workers:
                worker.kill()
            group.destroy()
            raise
        self._finalizer = weakref.finalize(self, _stop, self.workers)
        _active = weakref.ref(self)
        logger.info("tensor parallel: %d ranks, %d worker processes", size, len(self.workers))

    def __getattr__(self, name: str):
        return getattr(self.local, name)  # device, dtype, args, model, num_kv_blocks, ...

    def run(self, batch: ScheduledBatch, lora: LoRAStep | None = None):
        try:
            group.broadcast(("run", _rows(batch), _lora(lora)))
            return self.local.run(batch, lora)
        except Exception as exc:
            self._check_ranks(exc)
            raise

    def _check_ranks(self, exc: Exception | None = None) -> None:
        """Raise RankLost if a worker has exited (a failed collective usually means one has)."""
        for rank, worker in enumerate(self.workers, start=1):
            worker.join(timeout=0.5 if exc is not None else 0)
            if not worker.is_alive():
                raise RankLost(f"tensor-parallel rank {rank} exited (exit code "
                               f"{worker.exitcode}): the model cannot run without it") from exc

    def mirror(self, pool) -> None:
        """Make every rank apply `pool`'s reserve / fill / clear, in this rank's order."""
        for op in ("reserve", "fill", "clear"):
            local = getattr(pool, op)

            def mirrored(*args, _op=op, _local=local):
                try:
                    group.broadcast((_op, *args))
                except Exception as exc:
                    self._check_ranks(exc)
                    raise
                return _local(*args)
            setattr(pool, op, mirrored)

    def slot_tables(self, pool) -> list:
        """Every rank's slot_table(pool), in rank order: what a test compares across ranks."""
        group.broadcast(("tables",))
        return group.gather(slot_table(pool))

    def close(self) -> None:
        self._finalizer()


def slot_table(pool) -> dict:
    """What every rank must agree on about its slots: each pool's ranks and scales per slot
    (its A and B are this rank's parts, so they differ), and which slots adapt the vocabulary."""
    pools = {name: (lora.ranks.tolist(), lora.scales.tolist())
             for name, lora in _pools(pool) if lora is not None}
    return {"pools": pools, "embed": sorted(pool.embed_slots), "head": sorted(pool.head_slots)}


def _pools(pool):
    for index, linear in pool._projections():
        yield f"layers.{index}.{linear.slice_names[0]}", linear.lora
    yield "embed_tokens", pool.embedding.lora
    yield "lm_head", pool.head.lora


def _stop(workers) -> None:
    try:
        group.broadcast(("stop",))
    except Exception:  # a dead rank: nothing to tell
        pass
    for worker in workers:
        worker.join(timeout=10)
        if worker.is_alive():
            worker.kill()
    group.destroy()
