"""Parts of a QuantWeight: the rows of one output slice (a merged projection's q, k or v, a
column-parallel rank's share) and a row-parallel rank's input columns. A column split that
would cut a quantization group (its scale belongs to two ranks) is refused, named; so is one
that would cut a dynamic activation group, except the whole row (per token), whose scale the
ranks then share through a max over them (ActQuant.spans_ranks)."""

from __future__ import annotations

from dataclasses import replace

from loragw.kernels.act_quant import ActQuant
from loragw.kernels.quant import QuantWeight


def rows(w: QuantWeight, start: int, length: int) -> QuantWeight:
    """Output rows [start, start + length)."""
    return w.rows(start, length)


def columns(w: QuantWeight, start: int, length: int, name: str) -> QuantWeight:
    """Input columns [start, start + length) of checkpoint tensor `name` (a row-parallel rank's)."""
    if (start, length) == (0, w.in_features):
        return w
    end = start + length
    w = replace(w, act=_act_columns(w, start, length, name))
    if w.kind == "int4" and (start % 2 or (length % 2 and end != w.in_features)):
        raise ValueError(f"tensor parallelism would split {name}'s int4 columns inside a byte "
                         f"(columns {start}..{end}); use another --tensor-parallel-size")
    byte = slice(start // 2, -(-end // 2)) if w.kind == "int4" else slice(start, end)
    qweight = w.qweight[:, byte]
    if w.g_idx is not None:  # act order: every rank keeps every group's scales
        return replace(w, qweight=qweight, g_idx=w.g_idx[:, start:end], in_features=length)
    size = w.group_size
    if size >= w.in_features:  # one scale per row: it serves every rank
        return replace(w, qweight=qweight, group_size=length, in_features=length)
    if start % size or (length % size and end != w.in_features):
        raise ValueError(f"tensor parallelism would cut a quantization group of {name} "
                         f"(groups of {size} columns, this rank's columns {start}..{end}); use "
                         "a --tensor-parallel-size that splits its input into whole groups")
    groups = slice(start // size, -(-end // size))
    return replace(w, qweight=qweight, scales=w.scales[:, groups],
                   zeros=None if w.zeros is None else w.zeros[:, groups], in_features=length)


def _act_columns(w: QuantWeight, start: int, length: int, name: str) -> ActQuant | None:
    """The input quantization of a row-parallel rank's columns: static scales hold for any
    column; a dynamic group wholly on this rank is computed here; the whole row (per token, or
    one group as wide as it) is each rank's part, its amax maxed over the ranks."""
    act = w.act
    if act is None or not act.dynamic:
        return act
    size, end = act.group_size, start + length
    if size is None or size >= w.in_features:
        return replace(act, group_size=None, spans_ranks=True)
    if start % size or length % size:
        raise ValueError(f"tensor parallelism would cut an activation group of {name} (groups "
                         f"of {size} columns, this rank's columns {start}..{end}); use a "
                         "--tensor-parallel-size that splits its input into whole groups")
    return act
