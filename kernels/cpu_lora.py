"""The CPU's bag-table LoRA path in C (kernels/csrc/lora_bags.c, built by kernels/native.py):
every token of a decode group through its own slot's A and B tables in one call per projection,
where kernels/reference.py `_apply_bagged` runs an embedding bag per slice plus the casts,
copies and adds around them. Same sums in the same order; float32 only. Used once it has
been built and matched `_apply_bagged` on a small random pool at first use; otherwise (no C
compiler, another dtype) `_apply_bagged` serves.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
from torch import Tensor

from loragw.kernels import native
from loragw.kernels.cpu_dispatch import BagTables, GatherGroup

logger = logging.getLogger(__name__)


@functools.cache
def _kernel():
    return native.function("lora_bags", "lora_bags_f32", "plplppiipiipppp", "i")


def apply_bags(out: Tensor, x: Tensor, tables: BagTables, active: list[int],
               offsets: tuple[tuple[int, int], ...], group: GatherGroup) -> None:
    """out[row, lo_i:hi_i] += the group's tokens' LoRA deltas of the `active` slices (see the
    C source). out: [T, O], x: [T, H] float32, each row contiguous; tables contiguous (as
    kernels/cpu_dispatch.py builds them)."""
    n = len(offsets)
    arrays = tables.native.get(tuple(active))
    if arrays is None:  # once per tables and active slices, not per call (56 calls a step)
        arrays = tables.native[tuple(active)] = (
            (ctypes.c_int32 * (n + 1))(*tables.cols),
            (ctypes.c_int32 * n)(*(a for a, _ in offsets)),
            (ctypes.c_int32 * n)(*(b - a for a, b in offsets)),
            (ctypes.c_int64 * n)(*(tables.b[i].data_ptr() if i in active else 0 for i in range(n))))
    rows = None if isinstance(group.rows, slice) else group.rows.contiguous()
    slots = group.slots.contiguous()
    failed = _kernel()(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
                       rows.data_ptr() if rows is not None else None, slots.data_ptr(),
                       group.num_tokens, x.shape[1], tables.a.data_ptr(), tables.a.shape[1], n,
                       *arrays)
    if failed:
        raise MemoryError("the CPU LoRA kernel could not allocate its buffers")


def usable(out: Tensor, x: Tensor) -> bool:
    """Whether apply_bags serves this call: float32 rows on the CPU, and the kernel built and
    checked (once per process)."""
    return (out.dtype == x.dtype == torch.float32 and out.device.type == "cpu"
            and out.stride(1) == 1 and x.stride(1) == 1 and _checked())


@functools.cache
def _checked() -> bool:
    problem = self_check()
    if problem is not None:
        logger.warning("the CPU LoRA kernel is off, embedding bags serve: %s", problem)
    return problem is None


def self_check() -> str | None:
    """Why apply_bags must not serve here (None: it may): built, then compared with the same
    sums in float64 on a small random pool of mixed ranks, with a slice no slot adapts and a
    group that is an index of rows."""
    from loragw.kernels.cpu_dispatch import _build_tables

    try:
        g = torch.Generator().manual_seed(0)
        S, H, R, edges = 3, 24, 4, (0, 8, 12, 20)
        ranks = torch.tensor([[4, 2, 3], [0, 0, 0], [1, 4, 4]])
        tables = _build_tables(torch.randn(3, S, R, H, generator=g),
                               torch.randn(S, 20, R, generator=g), ranks,
                               torch.rand(3, S, generator=g), edges, ())
        x, out = torch.randn(6, H, generator=g), torch.randn(6, 20, generator=g)
        group = GatherGroup(torch.tensor([5, 0, 3, 2]), torch.tensor([2, 0, 1, 0]), (0, 1, 2), 4)
        offsets = tuple(zip(edges, edges[1:]))
        want = out.double()
        a = tables.a.double().view(S, H, -1)
        for row, slot in zip(group.rows.tolist(), group.slots.tolist()):
            y = x[row].double() @ a[slot]                                       # [sum R]
            for i in (0, 2):
                c0, c1 = tables.cols[i], tables.cols[i + 1]
                b = tables.b[i].double().view(S, c1 - c0, -1)[slot]             # [R_i, width]
                want[row, offsets[i][0]:offsets[i][1]] += y[c0:c1] @ b
        apply_bags(out, x, tables, [0, 2], offsets, group)
        error = (out.double() - want).abs().max().item()
        if not error <= 1e-4:
            return f"max error {error:.2e} against float64"
    except Exception as exc:  # no compiler, a failed build or load
        return native.exception_problem(exc)
    return None
