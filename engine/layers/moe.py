"""The sparse Mixture-of-Experts block: a router picks top_k of E expert MLPs for every token.

    probs   = softmax(x W_gate^T)            (float32)
    w, ids  = top_k(probs)                   (renormalised to sum 1 where norm_topk_prob)
    out[t]  = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j]
            (+ sigmoid(x W_sg^T) * shared_expert(x), Qwen2-MoE)

The router is an engine Linear named `gate` and the shared expert is the Llama MLP, so their
LoRAs attach like any projection's. Expert weights are stored fused, as transformers 5 holds
them in memory: `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I].

Tokens are grouped by expert: the T*k (token, choice) pairs are sorted by expert id (stable,
so each expert's rows stay in token order), each non-empty expert segment is one matmul, and
each token's k weighted rows are gathered back and summed in expert order, as transformers
adds them. The segment
sizes cost one host sync per layer, which a CUDA graph cannot capture; under capture every
expert instead runs over every pair row (E/k times the work, no sync), each row keeping only
its own expert's result.

Expert LoRA (engine/layers/moe_lora.py) adds its delta to the grouped pre-activation h and to
the grouped down output before the routing weight, as PEFT's target_parameters LoRA adds to W_e.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loragw.engine.layers.linear import Linear
from loragw.engine.layers.moe_lora import apply_expert_lora
from loragw.engine.layers.parts import Block, Loadable

# per-expert checkpoint projection -> (our fused parameter, its row half: 0 gate, 1 up, None all)
PER_EXPERT = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0),
              "w3": ("gate_up_proj", 1), "up_proj": ("gate_up_proj", 1),
              "w2": ("down_proj", None), "down_proj": ("down_proj", None)}
HALVES = ("gate_proj", "up_proj")


@dataclass(frozen=True)
class Routing:
    """top_k of num_experts by softmax score (config.json's other router scoring_func values
    are refused with the config, engine/models/moe.py)."""

    num_experts: int
    top_k: int
    norm_topk_prob: bool  # renormalise the top-k weights to sum 1
    # Mixtral multiplies expert outputs by float32 weights; the others cast them to the model's
    # dtype first. Only visible in bf16 / fp16, but that is where it is served.
    float32_weights: bool = False


class Experts(nn.Module, Loadable):
    """E expert MLPs (SiLU-gated), fused; `lora` is the expert LoRA's buffers (None: none)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        E, H, inter = num_experts, hidden_size, intermediate_size
        self.num_experts, self.intermediate_size = E, inter
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, H), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, inter), requires_grad=False)
        self.lora = None  # {"gate_up_proj": ..., "down_proj": ...}, set by the expert LoRA pool

    def checkpoint_keys(self, param_name: str) -> Iterator[str]:
        """What fills `param_name` (…experts.gate_up_proj or …down_proj) from a per-expert
        checkpoint: one key per expert and half. A fused checkpoint fills the whole name."""
        halves = HALVES if param_name.endswith("gate_up_proj") else ("down_proj",)
        for e in range(self.num_experts):
            yield from (f"{param_name}:{e}:{half}" for half in halves)

    def per_expert_target(self, param: str, expert: int, half: int | None) -> torch.Tensor:
        """The rows of our fused parameter that a per-expert checkpoint tensor fills."""
        weight = getattr(self, param)[expert]  # [2I, H] or [H, I]
        if half is None:
            return weight
        return weight[half * self.intermediate_size:(half + 1) * self.intermediate_size]

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        # x: [T, H]  topk_ids: [T, k] int64  topk_weights: [T, k] -> out: [T, H] (x's dtype)
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)  # [N = T*k], pair t*k + j
        order = torch.argsort(flat, stable=True)  # [N] pairs grouped by expert, token order inside
        expert_ids = flat[order]  # [N] int64, non-decreasing
        token_index = order // k  # [N] the token each grouped row came from
        x_sorted = x[token_index]  # [N, H]
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        grouped = self._every_expert if capturing else self._segments(flat)
        h = grouped(x_sorted, self.gate_up_proj, expert_ids)  # [N, 2I], pre-activation
        apply_expert_lora(self.lora, "gate_up_proj", h, x_sorted, expert_ids, token_index)
        gate, up = h.chunk(2, dim=-1)
        a = F.silu(gate) * up  # [N, I]
        y = grouped(a, self.down_proj, expert_ids)  # [N, H]
        apply_expert_lora(self.lora, "down_proj", y, a, expert_ids, token_index)
        y = (y * topk_weights.reshape(-1)[order, None]).to(x.dtype)  # [N, H]
        # Each token's k rows summed in expert order, as transformers' index_add adds them
        # (CPU index_add_ is a slow scatter; k gathers and adds are not).
        sorted_row = torch.empty_like(order)
        sorted_row[order] = torch.arange(order.numel(), device=order.device)
        by_expert = topk_ids.argsort(dim=1, stable=True)  # [T, k] choices, lowest expert first
        rows = sorted_row.view(-1, k).gather(1, by_expert)  # [T, k] rows of y
        out = y[rows[:, 0]]
        for j in range(1, k):
            out = out + y[rows[:, j]]
        return out  # [T, H]

    def _segments(self, flat: torch.Tensor):
        """rows -> out: row r through its expert's weight, one matmul per non-empty segment."""
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync

        def grouped(rows: torch.Tensor, weight: torch.Tensor, _ids) -> torch.Tensor:
            # rows: [N, in]  weight: [E, out, in] -> [N, out]
            out = rows.new_empty(rows.shape[0], weight.shape[1])
            start = 0
            for e, n in enumerate(counts):
                if n:
                    torch.mm(rows[start:start + n], weight[e].t(), out=out[start:start + n])
                start += n
            return out
        return grouped

    def _every_expert(self, rows: torch.Tensor, weight: torch.Tensor,
                      expert_ids: torch.Tensor) -> torch.Tensor:
        """The same as _segments without a host sync (for CUDA graph capture)."""
        out = rows.new_zeros(rows.shape[0], weight.shape[1])
        for e in range(self.num_experts):
            mine = (expert_ids == e).unsqueeze(1)  # [N, 1]
            out = torch.where(mine, rows @ weight[e].t(), out)
        return out


class SparseMoeBlock(Block):
    def __init__(self, hidden_size: int, intermediate_size: int, routing: Routing,
                 shared_expert: Block | None = None):
        """shared_expert: an MLP every token also runs, scaled by sigmoid(shared_expert_gate)."""
        super().__init__()
        self.routing = routing
        self.gate = Linear(hidden_size, {"gate": routing.num_experts})
        self.experts = Experts(routing.num_experts, hidden_size, intermediate_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (Linear(hidden_size, {"shared_expert_gate": 1})
                                   if shared_expert is not None else None)

    def lora_linears(self) -> Iterator[Linear]:
        """The router, then the shared expert's projections and its gate (Qwen2-MoE)."""
        yield self.gate
        if self.shared_expert is not None:
            yield from self.shared_expert.lora_linears()
            yield self.shared_expert_gate

    def expert_modules(self) -> Iterator[Experts]:
        yield self.experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> topk_ids [T, k] int64, topk_weights [T, k] (float32 or x's dtype)
        r = self.routing
        logits = self.gate(x)  # [T, E], x's dtype
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, r.top_k, dim=-1)
        if r.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights if r.float32_weights else weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        ids, weights = self.route(x)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
