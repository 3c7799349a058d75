"""The CPU's bag-table LoRA path in C (kernels/csrc/lora_bags.c, built by kernels/native.py):
every token of a decode group through its own slot's A and B tables in one call per projection,
where kernels/reference.py `_apply_bagged` runs an embedding bag per slice plus the casts,
copies and adds around them. Same sums in the same order, x and out float32 or bfloat16 (the
tables are float32 either way; a bf16 delta is rounded before it is added, as `_apply_bagged`
rounds it). Used for a dtype once it has been built and matched float64 on a small random pool
of that dtype at first use; otherwise (no C compiler, float16) `_apply_bagged` serves.
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

DTYPES = tuple(native.SUFFIXES)  # float32, bfloat16
# the self-check's largest |out - float64's| over the output's scale: float32's sums; bfloat16's
# two roundings of out (the delta's, the sum's: 2^-8 relative each)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@functools.cache
def _kernel(dtype: torch.dtype):
    return native.function("lora_bags", f"lora_bags_{native.SUFFIXES[dtype]}", "plplppiipiipppp",
                           "i")


def apply_bags(out: Tensor, x: Tensor, tables: BagTables, active: list[int],
               offsets: tuple[tuple[int, int], ...], group: GatherGroup) -> None:
    """out[row, lo_i:hi_i] += the group's tokens' LoRA deltas of the `active` slices (see the
    C source). out: [T, O], x: [T, H] both float32 or both bfloat16, each row contiguous; tables
    contiguous float32 (as kernels/cpu_dispatch.py builds them)."""
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
    failed = _kernel(x.dtype)(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
                              rows.data_ptr() if rows is not None else None, slots.data_ptr(),
                              group.num_tokens, x.shape[1], tables.a.data_ptr(),
                              tables.a.shape[1], n, *arrays)
    if failed:
        raise MemoryError("the CPU LoRA kernel could not allocate its buffers")


def usable(out: Tensor, x: Tensor) -> bool:
    """Whether apply_bags serves this call: float32 or bfloat16 rows on the CPU, and the kernel
    built and checked for that dtype (once per process)."""
    return (out.dtype == x.dtype and x.dtype in DTYPES and out.device.type == "cpu"
            and out.stride(1) == 1 and x.stride(1) == 1 and _checked(x.dtype))


@functools.cache
def _checked(dtype: torch.dtype) -> bool:
    problem = self_check(dtype)
    if problem is not None:
        logger.warning("the CPU LoRA kernel is off for %s, embedding bags serve: %s", dtype,
                       problem)
    return problem is None


def self_check(dtype: torch.dtype = torch.float32) -> str | None:
    """Why apply_bags must not serve `dtype` here (None: it may): built, then compared with the
    same sums in float64 on a small random pool of mixed ranks, with a slice no slot adapts and
    a group that is an index of rows."""
    from loragw.kernels.cpu_dispatch import _build_tables

    try:
        g = torch.Generator().manual_seed(0)
        S, H, R, edges = 3, 24, 4, (0, 8, 12, 20)
        ranks = torch.tensor([[4, 2, 3], [0, 0, 0], [1, 4, 4]])
        tables = _build_tables(torch.randn(3, S, R, H, generator=g),
                               torch.randn(S, 20, R, generator=g), ranks,
                               torch.rand(3, S, generator=g), edges, ())
        x, out = (torch.randn(6, width, generator=g).to(dtype) for width in (H, 20))
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
        error = (out.double() - want).abs().max().item() / max(1.0, want.abs().max().item())
        if not error <= TOLERANCE[dtype]:
            return f"relative error {error:.2e} against float64 > {TOLERANCE[dtype]:.0e}"
    except Exception as exc:  # no compiler, a failed build or load
        return native.exception_problem(exc)
    return None
