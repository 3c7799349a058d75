"""The tensor-parallel process group: torch.distributed (NCCL on CUDA, gloo on the CPU), plus a
gloo group for the per-step control message, every collective under one timeout.

Layers call `all_reduce` / `all_gather` unconditionally: with one rank (the default, and the
only state before `init`) both return their input, so a single-device engine pays nothing.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loragw.engine.distributed.shard import Shard

logger = logging.getLogger(__name__)


@dataclass
class _Group:
    shard: Shard
    control: object = None  # the gloo group control messages travel in


_current = _Group(Shard())


def init(shard: Shard, init_method: str, device: torch.device, timeout_s: float) -> None:
    """Join the group as `shard.rank` of `shard.size` (every rank calls this)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=shard.rank,
                            world_size=shard.size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    _current.shard, _current.control = shard, control
    logger.info("tensor-parallel rank %d of %d joined (%s)", shard.rank, shard.size, backend)


def shard() -> Shard:
    return _current.shard


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over the ranks, in place."""
    if _current.shard.size > 1:
        dist.all_reduce(t)
    return t


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """[..., n] per rank -> [..., size * n]: every rank's part, in rank order, on every rank."""
    if _current.shard.size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(_current.shard.size)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast(message: object = None) -> object:
    """Rank 0's `message` on every rank (a picklable object: the step's control message)."""
    box = [message]
    dist.broadcast_object_list(box, src=0, group=_current.control)
    return box[0]


def gather(obj: object) -> list[object]:
    """Every rank's `obj`, in rank order, on every rank (a picklable object)."""
    out = [None] * _current.shard.size
    dist.all_gather_object(out, obj, group=_current.control)
    return out


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _current.shard, _current.control = Shard(), None
