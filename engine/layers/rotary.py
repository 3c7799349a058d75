"""Rotary position embedding with the `default`, `linear`, `llama3` and `longrope` frequency
schedules, over the first `partial_rotary_factor` of each head (Phi-4-mini: 0.75).

Frequencies are computed exactly as Hugging Face computes them, so cos/sin match bit for bit.
`longrope` (Phi-3-128k, Phi-3.5, Phi-4-mini; old configs say "su") scales frequencies by
`short_factor` and cos/sin by an attention factor; Hugging Face switches a whole sequence to
`long_factor` (recomputing its KV cache) once it is longer than original_max_position_embeddings.
This engine does not switch, so it serves longrope only up to that length (see `reserve`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from loragw.engine.forward.context import elementwise

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class RopeArgs:
    """One rope schedule, as a checkpoint describes it (engine/models/args.py reads it from
    config.json, old style or new, once). Frequencies follow `rope_type`; each names the
    fields it reads."""

    rope_type: str = "default"  # SUPPORTED_ROPE_TYPES
    theta: float = 10000.0
    partial_rotary_factor: float = 1.0  # of each head's dimensions, the share that rotates
    max_position_embeddings: int = 4096
    factor: float | None = None  # linear, llama3
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    # llama3: the pretraining length its smoothing is keyed to; longrope: the length whose
    # short factors hold (see the module docstring)
    original_max_position_embeddings: int | None = None
    short_factor: tuple[float, ...] = ()  # longrope
    attention_factor: float = 1.0  # longrope's scale of cos and sin

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope scaling type {self.rope_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

    @property
    def exact_context(self) -> int | None:
        """The longest sequence this engine serves the schedule exactly for: longrope's
        original_max_position_embeddings (the module docstring); None for the others."""
        return self.original_max_position_embeddings if self.rope_type == "longrope" else None


def rotary_dim(head_dim: int, rope: RopeArgs) -> int:
    """How many of a head's dimensions rotate (the rest pass through)."""
    return int(head_dim * rope.partial_rotary_factor)


def inverse_frequencies(dim: int, rope: RopeArgs) -> torch.Tensor:
    """[dim / 2] for the `dim` rotating dimensions of a head."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    if rope.rope_type == "longrope":  # the short factors: see the module docstring
        short = torch.tensor(rope.short_factor, dtype=torch.float32, device="cpu")
        if short.shape != exponents.shape:
            raise ValueError(f"rope_scaling short_factor has {short.numel()} entries; "
                             f"{dim} rotating dimensions need {exponents.numel()}")
        return 1.0 / (short * rope.theta ** exponents)
    inv_freq = 1.0 / (rope.theta ** exponents)  # [dim / 2]
    if rope.rope_type == "linear":
        inv_freq /= rope.factor
    elif rope.rope_type == "llama3":
        factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
        old_len = rope.original_max_position_embeddings or rope.max_position_embeddings
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope: RopeArgs):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = rope.max_position_embeddings
        self.inv_freq = inverse_frequencies(rotary_dim(head_dim, rope), rope)
        self.attention_factor = rope.attention_factor  # cos and sin scale
        self.short_only = rope.exact_context  # longrope's short factors hold up to this
        # (device, dtype, cos, sin) with cos, sin: [max_positions, rotary dim], built on first use
        self._table: tuple[torch.device, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def reserve(self, num_positions: int) -> None:
        """Positions the table must cover (the engine's max_model_len): built once, so a step
        never checks its positions on the host (a sync, and no CUDA graph could replay it)."""
        if self.short_only is not None and num_positions > self.short_only:
            raise ValueError(
                f"max_model_len {num_positions} > original_max_position_embeddings "
                f"{self.short_only} of this longrope model: past that length Hugging Face "
                "switches the whole sequence to rope_scaling's long_factor (recomputing its KV "
                "cache), which this engine does not do; restart with --max-model-len "
                f"{self.short_only} or less")
        if num_positions > self.max_positions:
            self.max_positions, self._table = num_positions, None

    def _build(self, device: torch.device, dtype: torch.dtype) -> None:
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float)
        freqs = positions[:, None] * self.inv_freq.to(device)[None, :]  # [P, rotary dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        # Computed in float32 and cast once, as Hugging Face casts them per call.
        cos, sin = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        self._table = (device, dtype, cos.to(dtype), sin.to(dtype))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin for these positions (each < max_positions): [T, 1, rotary dim] each."""
        table = self._table
        if table is None or table[0] != positions.device or table[1] != dtype:
            self._build(positions.device, dtype)
            table = self._table
        return table[2][positions][:, None, :], table[3][positions][:, None, :]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    # q: [T, n_heads, D]  k: [T, n_kv_heads, D]  cos, sin: [T, 1, rot]: dims past rot pass through
    rot = cos.shape[-1]
    if rot < q.shape[-1]:
        (q_rot, q_pass), (k_rot, k_pass) = (t.split([rot, t.shape[-1] - rot], -1) for t in (q, k))
        q_rot, k_rot = apply_rotary(q_rot, k_rot, cos, sin)
        return torch.cat((q_rot, q_pass), -1), torch.cat((k_rot, k_pass), -1)
    return elementwise().rotary(q, k, cos, sin)
