"""Rotary position embedding with the `default`, `linear` and `llama3` frequency schedules.

Frequencies are computed exactly as Hugging Face computes them, so cos/sin match bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: dict) -> dict:
    """The rope dict of a config.json, old style (`rope_theta` + `rope_scaling`) or new
    (`rope_parameters`), normalised to one dict with `rope_type` and `rope_theta`."""
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = hf_config.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    params["rope_type"] = rope_type
    return params


def inverse_frequencies(head_dim: int, params: dict, max_position_embeddings: int) -> torch.Tensor:
    base = params["rope_theta"]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base ** exponents)  # [head_dim / 2]
    if params["rope_type"] == "linear":
        inv_freq /= params["factor"]
    elif params["rope_type"] == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params.get("original_max_position_embeddings", max_position_embeddings)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, hf_config: dict):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = hf_config.get("max_position_embeddings", 4096)
        self.inv_freq = inverse_frequencies(head_dim, rope_parameters(hf_config), self.max_positions)
        # (device, dtype, cos, sin) with cos, sin: [max_positions, head_dim], built on first use
        self._table: tuple[torch.device, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def reserve(self, num_positions: int) -> None:
        """Positions the table must cover (the engine's max_model_len): built once, so a step
        never checks its positions on the host (a sync, and no CUDA graph could replay it)."""
        if num_positions > self.max_positions:
            self.max_positions, self._table = num_positions, None

    def _build(self, device: torch.device, dtype: torch.dtype) -> None:
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float)
        freqs = positions[:, None] * self.inv_freq.to(device)[None, :]  # [P, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        # Computed in float32 and cast once, as Hugging Face casts them per call.
        self._table = (device, dtype, emb.cos().to(dtype), emb.sin().to(dtype))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin for these positions (each < max_positions): [T, 1, head_dim] each."""
        table = self._table
        if table is None or table[0] != positions.device or table[1] != dtype:
            self._build(positions.device, dtype)
            table = self._table
        return table[2][positions][:, None, :], table[3][positions][:, None, :]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    # q: [T, n_heads, D]  k: [T, n_kv_heads, D]  cos, sin: [T, 1, D]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
