"""Expert LoRA: each grouped row of an MoE layer (engine/layers/moe.py) gets the delta of its own
token's adapter slot and its own expert, as PEFT's target_parameters LoRA adds to W_e:

    y[i] += scales[s] * lora_b[s, e] @ (lora_a[s, e] @ x[i])      s = slot of token_index[i],
                                                                   e = expert_ids[i]

The experts module's `lora` is {parameter name: ExpertLoRABuffers}, set by the slot pool
(engine/lora/expert_slots.py) when the first adapter with expert LoRA on that parameter is
registered; None before. Rows whose token has no adapter (slot -1), or whose slot holds no LoRA
on that parameter (scale 0), are left untouched.

Grouped, never a loop over rows, in float32; the adapted rows take one of two paths
(use_segments decides, per call):
    segments   rows sorted by (slot, expert) pair, two matmuls per non-empty pair with that
               pair's factors in place: prefill-sized groups, many rows a pair
    gathered   every row gathers its own pair's factors, two batched matmuls over chunks of
               rows bounded by GATHER_ELEMENTS ([n, R, in] and [n, out, R]): decode, about
               one row a pair, where a loop over pairs would be a loop over rows
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loragw.engine.forward.context import get_forward_context

# Most factor elements one chunk of rows gathers (fp32: 4 bytes each): a bound on the scratch
# memory of one call, whatever the number of rows.
GATHER_ELEMENTS = 1 << 24
# Mean adapted rows per non-empty (slot, expert) pair from which one matmul pair per pair beats
# gathering every row's factors (which copies R * (in + out) weights per row).
SEGMENT_ROWS = 4


@dataclass(slots=True)
class ExpertLoRABuffers:
    """One expert parameter's device slot pool: per slot, per expert, one LoRA pair."""

    lora_a: torch.Tensor  # [S, E, R, in]
    lora_b: torch.Tensor  # [S, E, out, R]
    scales: torch.Tensor  # [S] float32, 0 = no LoRA on this parameter in that slot
    ranks: list[int] = field(default_factory=list)  # [S] host copy: 0 = nothing in that slot

    @property
    def rank_bound(self) -> int:
        """The largest rank any slot holds: the factors' columns past it are zero everywhere."""
        return max(self.ranks, default=0)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.lora_a, self.lora_b, self.scales))


def rows_per_chunk(rank: int, in_features: int, out_features: int) -> int:
    """Rows one chunk gathers factors for: at most GATHER_ELEMENTS elements, at least one row."""
    return max(1, GATHER_ELEMENTS // (rank * (in_features + out_features)))


def use_segments(num_rows: int, num_pairs: int) -> bool:
    """Whether `num_rows` adapted rows over `num_pairs` non-empty (slot, expert) pairs take the
    segments path (module docstring) rather than the gathered one."""
    return num_rows >= SEGMENT_ROWS * num_pairs


def apply_expert_lora(lora: dict[str, ExpertLoRABuffers] | None, name: str, y: torch.Tensor,
                      x: torch.Tensor, expert_ids: torch.Tensor,
                      token_index: torch.Tensor) -> None:
    """y[i] += scales[s] * lora_b[s, e] @ (lora_a[s, e] @ x[i]), in place (module docstring).

    lora: the experts module's buffers (None: no expert LoRA registered)   name: "gate_up_proj"
    or "down_proj"   y: [N, out]   x: [N, in]   expert_ids, token_index: [N] int64, the expert
    and the step's token row of each grouped row. Returns at once when no row of the step has
    an adapter with expert LoRA (LoRAStep.experts). Steps that have one never run in a CUDA
    graph (engine/runner/graphs.py), so the rows and ranks are picked on the host.
    """
    if lora is None or name not in lora:
        return
    step = get_forward_context().lora
    if step is None or not step.experts:
        return
    buffers = lora[name]
    S, E, R, in_f = buffers.lora_a.shape
    r = buffers.rank_bound
    if r == 0:
        return
    out_f = buffers.lora_b.shape[2]
    slots = step.tokens.token_slots.long().index_select(0, token_index)  # [N], -1 = none
    scale = buffers.scales.index_select(0, slots.clamp(min=0))  # [N] fp32
    scale = torch.where(slots >= 0, scale, torch.zeros_like(scale))
    # [N] slot * E + expert of each adapted row; S * E (sorted last) for the others
    pairs = torch.where(scale != 0, slots.clamp(min=0) * E + expert_ids, S * E)
    counts = torch.bincount(pairs, minlength=S * E + 1).tolist()  # the one host sync
    n = len(pairs) - counts.pop()  # adapted rows
    if n == 0:
        return
    rows = torch.argsort(pairs, stable=True)[:n]  # [n] the adapted rows, grouped by pair
    pairs = pairs.index_select(0, rows)
    a_flat = buffers.lora_a.view(S * E, R, in_f)[:, :r]  # [S*E, r, in]
    b_flat = buffers.lora_b.view(S * E, out_f, R)[:, :, :r]  # [S*E, out, r]
    if use_segments(n, sum(1 for c in counts if c)):
        _segments(y, x, a_flat, b_flat, scale, rows, counts)
    else:
        _gathered(y, x, a_flat, b_flat, scale, rows, pairs)


def _segments(y, x, a_flat, b_flat, scale, rows, counts: list[int]) -> None:
    """rows grouped by pair, counts[p] of pair p: y[seg] += scale * (x[seg] @ a[p].T) @ b[p].T."""
    start = 0
    for p, n in enumerate(counts):
        if not n:
            continue
        seg = rows[start:start + n]
        start += n
        xs = x.index_select(0, seg).float()  # [c, in]
        xa = (xs @ a_flat[p].float().T) * scale.index_select(0, seg)[:, None]  # [c, r]
        y.index_add_(0, seg, (xa @ b_flat[p].float().T).to(y.dtype))  # [c, out]


def _gathered(y, x, a_flat, b_flat, scale, rows, pairs) -> None:
    """Every row its own pair's factors: two bmm over chunks of rows_per_chunk rows."""
    r, in_f, out_f = a_flat.shape[1], a_flat.shape[2], b_flat.shape[1]
    step_rows = rows_per_chunk(r, in_f, out_f)
    for start in range(0, rows.shape[0], step_rows):
        chunk = rows[start:start + step_rows]  # [n]
        pair = pairs[start:start + step_rows]
        xs = x.index_select(0, chunk).float().unsqueeze(2)  # [n, in, 1]
        xa = torch.bmm(a_flat.index_select(0, pair).float(), xs)  # [n, r, 1]
        xa *= scale.index_select(0, chunk)[:, None, None]
        delta = torch.bmm(b_flat.index_select(0, pair).float(), xa).squeeze(2)  # [n, out]
        y.index_add_(0, chunk, delta.to(y.dtype))

