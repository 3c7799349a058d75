"""The Llama family (Llama, Mistral, Qwen2, Qwen3) as one model.

Differences are config switches: Qwen2 adds q/k/v biases, Qwen3 adds per-head q/k RMSNorm,
Mistral (`sliding_window`) and Qwen2 (`use_sliding_window`) may slide some layers' attention.
Projections are merged (qkv_proj, gate_up_proj) with named output slices, so checkpoint
tensors and LoRA adapters attach by their Hugging Face names; embed_tokens and lm_head carry
LoRAs too (engine/layers/embedding.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from loragw.engine.distributed.shard import Shard
from loragw.engine.forward.context import elementwise
from loragw.engine.layers.attention import PagedAttention
from loragw.engine.layers.embedding import VocabEmbedding
from loragw.engine.layers.linear import Linear
from loragw.engine.layers.norm import RMSNorm
from loragw.engine.layers.parts import Block
from loragw.engine.layers.rotary import RotaryEmbedding, apply_rotary
from loragw.engine.models.args import ModelArgs
from loragw.engine.models.base import CausalLM, Layer


class Attention(Block):
    def __init__(self, args: ModelArgs, shard: Shard, *, scale: float | None = None,
                 sliding_window: int | None = None, softcap: float | None = None,
                 norm: type[nn.Module] = RMSNorm):
        """scale: of the scores (default head_dim ** -0.5); norm: the q/k norm's class."""
        super().__init__()
        d = args.head_dim
        q0, heads = shard.split(args.num_heads, "num_attention_heads")
        kv0, kv_heads = shard.kv_heads(args.num_heads, args.num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, d
        tp = shard.size > 1
        self.qkv_proj = Linear(args.hidden_size, {"q_proj": heads * d, "k_proj": kv_heads * d,
                                                  "v_proj": kv_heads * d},
                               bias=args.attention_bias,
                               sources=dict(q_proj=q0 * d, k_proj=kv0 * d, v_proj=kv0 * d)
                               if tp else None)
        self.o_proj = Linear(heads * d, {"o_proj": args.hidden_size},
                             sources={"*": q0 * d} if tp else None, row_parallel=tp)
        # q/k norm (ModelArgs.qk_norm): over each head's D, over all of q and of k ("whole":
        # before the head split), or the identity
        self.qk_norm_whole = args.qk_norm == "whole"
        q_width, k_width = (heads * d, kv_heads * d) if self.qk_norm_whole else (d, d)
        self.q_norm = norm(q_width, args.rms_norm_eps) if args.qk_norm else nn.Identity()
        self.k_norm = norm(k_width, args.rms_norm_eps) if args.qk_norm else nn.Identity()
        self.clip_qkv = args.clip_qkv
        self.attn = PagedAttention(heads, kv_heads, d, scale=d ** -0.5 if scale is None else scale,
                                   sliding_window=sliding_window, softcap=softcap)

    def lora_linears(self) -> Iterator[Linear]:
        yield from (self.qkv_proj, self.o_proj)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]  rope: (cos, sin) [T, 1, D] each
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        if self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)  # [T, n_heads * D], [T, n_kv * D]
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, n_heads, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, n_kv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        return self.o_proj(self.attn(q, k, v))


class MLP(Block):
    def __init__(self, args: ModelArgs, shard: Shard,
                 act: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self.act = act  # None: SwiGLU; Gemma's GeGLU passes gelu
        i0, inter = shard.split(args.intermediate_size, "intermediate_size")
        tp = shard.size > 1
        self.gate_up_proj = Linear(args.hidden_size, {"gate_proj": inter, "up_proj": inter},
                                   sources=dict(gate_proj=i0, up_proj=i0) if tp else None)
        self.down_proj = Linear(inter, {"down_proj": args.hidden_size},
                                sources={"*": i0} if tp else None, row_parallel=tp)

    def lora_linears(self) -> Iterator[Linear]:
        yield from (self.gate_up_proj, self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if self.act is None:  # SwiGLU: the step's Elementwise (engine/forward/elementwise.py)
            return self.down_proj(elementwise().silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(Layer):
    def __init__(self, args: ModelArgs, shard: Shard, window: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, shard, sliding_window=window)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args, shard)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        x, h = self.post_attention_layernorm.add(x, self.self_attn(rope, self.input_layernorm(x)))
        return x + self.mlp(h)


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, shard: Shard, layers: list[nn.Module] | None = None):
        """layers: a family's own decoder layers (MoE's), else Llama's."""
        super().__init__()
        self.embed_tokens = VocabEmbedding(args.vocab_size, args.hidden_size, shard)
        self.layers = nn.ModuleList(layers if layers is not None else (
            DecoderLayer(args, shard, window) for window in args.layer_windows))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args.head_dim, args.rope)  # shared by every layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(rope, x)
        return self.norm(x)


class LlamaForCausalLM(CausalLM):
    """Llama's checkpoint names (merged q/k/v and gate/up), backbone and args."""

    # checkpoint name fragment -> (our module name, slice name)
    merged_projections = {"q_proj": ("qkv_proj", "q_proj"), "k_proj": ("qkv_proj", "k_proj"),
                          "v_proj": ("qkv_proj", "v_proj"), "gate_proj": ("gate_up_proj", "gate_proj"),
                          "up_proj": ("gate_up_proj", "up_proj")}

    @classmethod
    def make_args(cls, hf_config: dict) -> ModelArgs:
        return ModelArgs.from_hf_config(hf_config)

    def make_model(self, shard: Shard) -> nn.Module:
        return LlamaModel(self.args, shard)


# config.json "architectures" -> the class that serves it (engine/models/__init__.py)
ARCHITECTURES = {name: LlamaForCausalLM for name in (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")}
