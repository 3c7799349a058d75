"""The device side of the adapter slots: for every module an adapter can adapt, one buffer pool
holding `max_loras` slots of up to `max_lora_rank`, preallocated and refilled in place.

Four kinds of pool, each allocated once, when the first adapter that needs it is registered:
    projections    every decoder layer's Linear.lora (LoRABuffers), with the first adapter
    embed_tokens   VocabEmbedding.lora (EmbeddingLoRABuffers), with the first embedding LoRA
    lm_head        LMHead.lora (LoRABuffers, one slice), with the first lm_head LoRA
    experts        every MoE layer's Experts.lora (engine/lora/expert_slots.py), with the first expert LoRA
so a server whose adapters never touch the vocabulary ends holds no vocabulary-sized buffers.
Per slot, in elements (R = max_lora_rank, V = vocab, H = hidden):
    projections    R * (sum over layers and Linears of n_slices * in + out)
    embed_tokens   R * (V + H)       lm_head   R * (H + V)
Adapters with saved modules (modules_to_save) also hold a full-module slot, keyed by their
LoRA slot, whose copies are allocated per adapter (engine/lora/full_modules.py).
`num_bytes` reports what each kind holds.

Per step, `rows(batch)` gives the slot of every row (LoRARows: engine/forward/lora.py): of every
new token for the projections and embed_tokens, of every sampling row for lm_head; the model
runner makes the step's metas from it. The embed_tokens and lm_head LoRA run only when some
row's slot adapts them; the replaced rows only when some row's adapter has a saved module.

A tensor-parallel engine's pool has `replicas`, the worker ranks, which apply every reserve,
fill and clear after this pool did, in its order (a change that fails here is never sent).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from loragw.adapters.format import LoraAdapter
from loragw.adapters.types import EMBED_TOKENS, LM_HEAD
from loragw.engine.forward.lora import LoRARows
from loragw.engine.layers.embedding import EmbeddingLoRABuffers
from loragw.engine.layers.linear import Linear, LoRABuffers
from loragw.engine.lora.expert_slots import ExpertSlots
from loragw.engine.lora.full_modules import FullModuleSlots
from loragw.engine.models.llama import LlamaForCausalLM
from loragw.engine.sched.batch import ScheduledBatch

logger = logging.getLogger(__name__)

EMBED, HEAD = (None, EMBED_TOKENS), (None, LM_HEAD)  # their keys in LoraAdapter.modules


class SlotSink(Protocol):
    """Who else holds a copy of these slots (the tensor-parallel worker ranks) and must apply
    each change after this pool, in its order: engine/parallel/runner.py's RankSink. `table`:
    this pool's SlotPool.table() after the change, which theirs must equal."""

    def reserve(self, adapter: LoraAdapter, table: dict) -> None: ...

    def fill(self, index: int, adapter: LoraAdapter, table: dict) -> None: ...

    def clear(self, index: int, table: dict) -> None: ...


class SlotPool:
    def __init__(self, model: LlamaForCausalLM, num_slots: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype, num_full_slots: int = 0,
                 replicas: SlotSink | None = None):
        self.model = model
        self.num_slots, self.max_rank = num_slots, max_rank
        self.device, self.dtype = device, dtype
        self.replicas = replicas
        self.embedding = model.model.embed_tokens
        self.head = model.lm_head
        self.embed_slots: set[int] = set()  # slots whose adapter has an embed_tokens LoRA
        self.head_slots: set[int] = set()  # ... an lm_head LoRA
        self.full = FullModuleSlots(num_full_slots, device, dtype)  # ... saved modules
        self.experts = ExpertSlots(model, num_slots, max_rank, device, dtype)  # MoE experts
        self.linears: list[tuple[int, Linear]] = list(model.lora_linears())  # walked once
        # made with the projection pools, per slot and projection: each slice's A [R, in] and
        # B [out, R] views (a fill copies instead of slicing), and the (ranks, scales) written
        # there; a slice's buffers are zero past its rank, so the ranks say what to zero
        self.views: list[list[list[tuple[torch.Tensor, torch.Tensor]]]] | None = None
        self.tables: list[list[tuple[list[int], list[float]]]] = []

    @property
    def num_bytes(self) -> dict[str, int]:
        """Device bytes per kind of pool (0: not allocated)."""
        projections = sum(linear.lora.num_bytes for _, linear in self.linears
                          if linear.lora is not None)
        return {"projections": projections,
                EMBED_TOKENS: self.embedding.lora.num_bytes if self.embedding.lora else 0,
                LM_HEAD: self.head.lora.num_bytes if self.head.lora else 0,
                "full_modules": self.full.num_bytes, "experts": self.experts.num_bytes}

    # ---- allocation -------------------------------------------------------------------------
    def reserve(self, adapter: LoraAdapter) -> None:
        """Allocate the pools `adapter` needs that do not exist yet (once per kind)."""
        self._reserve(adapter)
        if self.replicas is not None:
            self.replicas.reserve(adapter, self.table())

    def _reserve(self, adapter: LoraAdapter) -> None:
        allocated = []
        if self.linears[0][1].lora is None:
            for _, linear in self.linears:
                linear.lora = self._linear_pool(len(linear.slice_names), linear.in_features,
                                                linear.out_features)
            self.views = [[[(linear.lora.lora_a[i, index],
                             linear.lora.lora_b[index, linear.slice_rows(name)])
                            for i, name in enumerate(linear.slice_names)]
                           for _, linear in self.linears] for index in range(self.num_slots)]
            self.tables = [[([0] * len(linear.slice_names), [0.0] * len(linear.slice_names))
                            for _, linear in self.linears] for _ in range(self.num_slots)]
            allocated.append("projections")
        if EMBED in adapter.modules and self.embedding.lora is None:
            S, R, V, H = self.num_slots, self.max_rank, self.embedding.vocab_size, self.embedding.hidden_size
            self.embedding.lora = EmbeddingLoRABuffers(
                lora_a=self._zeros(S, V, R), lora_b=self._zeros(S, H, R),
                ranks=torch.zeros(1, S, dtype=torch.int32, device=self.device),
                scales=torch.zeros(1, S, dtype=torch.float32, device=self.device))
            allocated.append(EMBED_TOKENS)
        if HEAD in adapter.modules and self.head.lora is None:
            self.head.lora = self._linear_pool(1, self.head.hidden_size, self.head.local_vocab)
            allocated.append(LM_HEAD)
        if self.experts.reserve(adapter):
            allocated.append("experts")
        if allocated:
            sizes = self.num_bytes
            logger.info("LoRA slot pools (%d slots, rank %d): %s", self.num_slots, self.max_rank,
                        ", ".join(f"{kind} {sizes[kind] / 2**20:.1f} MiB" for kind in sizes))

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.dtype, device=self.device)

    def _linear_pool(self, n: int, in_features: int, out_features: int) -> LoRABuffers:
        S, R = self.num_slots, self.max_rank
        return LoRABuffers(
            lora_a=self._zeros(n, S, R, in_features),  # [n_slices, S, R, H]
            lora_b=self._zeros(S, out_features, R),  # [S, O_total, R]
            ranks=torch.zeros(n, S, dtype=torch.int32, device=self.device),
            scales=torch.zeros(n, S, dtype=torch.float32, device=self.device))

    # ---- one slot ---------------------------------------------------------------------------
    def fill(self, index: int, adapter: LoraAdapter) -> None:
        """Copy `adapter` into slot `index`, over whatever the slot held: only what the old
        adapter wrote beyond the new one is zeroed (a slot's buffers are zero past the ranks
        written to them), so an eviction costs the new adapter's bytes, not a whole clear."""
        self._fill(index, adapter)
        if self.replicas is not None:
            self.replicas.fill(index, adapter, self.table())

    def _fill(self, index: int, adapter: LoraAdapter) -> None:
        self._reserve(adapter)
        self._clear_ends(index)  # the vocabulary ends, experts, saved modules: refilled below
        slices = adapter.by_slice()  # a fused module (Phi-3's qkv_proj) as q, k, v slices
        stale, dst, src, tables = [], [], [], []
        for p, (layer_index, linear) in enumerate(self.linears):
            ranks, scales = [], []
            for i, (name, target) in enumerate(zip(linear.slice_names, linear.lora_names)):
                weights = slices.get((layer_index, target))
                rank, old, (a, b) = (0 if weights is None else weights.rank,
                                     self.tables[index][p][0][i], self.views[index][p][i])
                if old > rank:  # the old adapter's columns past the new rank
                    stale += (a[rank:old], b[:, rank:old])
                if weights is not None:
                    # this rank's part (engine/layers/linear.py): A by input columns, B by rows
                    dst += (a, b) if rank == self.max_rank else (a[:rank], b[:, :rank])
                    src += (linear.local(name, weights.lora_a, 1),  # [r, in]
                            linear.local(name, weights.lora_b, 0))  # [out, r]
                ranks.append(rank)
                scales.append(0.0 if weights is None else weights.scaling)
            tables.append((ranks, scales))
        try:  # every projection's zeroing and copy in one call each
            if stale:
                torch._foreach_zero_(stale)
            if dst:
                torch._foreach_copy_(dst, src, non_blocking=True)
        except Exception:  # a half-written slot: all of it back to zero, then say why
            self._zero_projections(index, full=True)
            raise
        for p, (_, linear) in enumerate(self.linears):
            self._set_table(index, p, linear.lora, *tables[p])
        if (weights := adapter.modules.get(HEAD)) is not None:
            lora, rank = self.head.lora, weights.rank
            lora.lora_a[0, index, :rank].copy_(weights.lora_a, non_blocking=True)  # [r, H]
            lora.lora_b[index, :, :rank].copy_(self.head.local(weights.lora_b),  # vocab rows
                                               non_blocking=True)
            lora.ranks[0, index], lora.scales[0, index] = rank, weights.scaling
            self.head_slots.add(index)
        if (weights := adapter.modules.get(EMBED)) is not None:
            self.embed_slots.add(index)
            lora, rank = self.embedding.lora, weights.rank
            lora.lora_a[index, :, :rank].copy_(weights.lora_a.T, non_blocking=True)  # [V, r]
            lora.lora_b[index, :, :rank].copy_(weights.lora_b, non_blocking=True)  # [H, r]
            lora.ranks[0, index], lora.scales[0, index] = rank, weights.scaling
        if adapter.saved_modules:
            self.full.fill(index, adapter.saved_modules)
        self.experts.fill(index, adapter)

    def clear(self, index: int) -> None:
        self._clear(index)
        if self.replicas is not None:
            self.replicas.clear(index, self.table())

    def _clear(self, index: int) -> None:
        """Zero what slot `index` holds: the ranks written to it, not the whole slot."""
        self._clear_ends(index)
        if self.views is not None:  # the projection pools are allocated
            self._zero_projections(index)

    def _zero_projections(self, index: int, full: bool = False) -> None:
        """Zero slot `index` of every projection pool up to the ranks written there (`full`:
        the whole slot, whatever a failed fill left), ranks and scales included."""
        held = [x for p, views in enumerate(self.views[index]) for i, (a, b) in enumerate(views)
                if (r := self.max_rank if full else self.tables[index][p][0][i])
                for x in (a[:r], b[:, :r])]
        if held:
            torch._foreach_zero_(held)
        for p, (_, linear) in enumerate(self.linears):
            n = len(linear.slice_names)
            if full:
                self.tables[index][p] = ([self.max_rank] * n, [0.0] * n)  # forces the write
            self._set_table(index, p, linear.lora, [0] * n, [0.0] * n)

    def _set_table(self, index: int, p: int, lora: LoRABuffers, ranks: list[int],
                   scales: list[float]) -> None:
        """Projection p's ranks and scales of slot `index`: one write, none when unchanged."""
        if self.tables[index][p] == (ranks, scales):
            return
        if self.device.type == "cpu":  # through numpy: a torch index_put costs ~40 us a pool
            lora.ranks.numpy()[:, index], lora.scales.numpy()[:, index] = ranks, scales
        else:
            lora.ranks[:, index] = torch.tensor(ranks, dtype=torch.int32)
            lora.scales[:, index] = torch.tensor(scales, dtype=torch.float32)
        self.tables[index][p] = (ranks, scales)

    def _clear_ends(self, index: int) -> None:
        """Zero slot `index` of the pools beside the projections, where it holds something."""
        if index in self.experts.held:
            self.experts.clear(index)
        self.full.clear(index)
        for lora, slots in ((self.head.lora, self.head_slots),
                            (self.embedding.lora, self.embed_slots)):
            if index not in slots:
                continue
            slots.discard(index)
            if isinstance(lora, EmbeddingLoRABuffers):
                lora.lora_a[index].zero_()
            else:
                lora.lora_a[:, index].zero_()
            lora.lora_b[index].zero_()
            lora.ranks[:, index] = 0
            lora.scales[:, index] = 0.0

    # ---- per step ---------------------------------------------------------------------------
    def rows(self, batch: ScheduledBatch) -> LoRARows | None:
        """The slot of every row of `batch`, or None when no row has an adapter (then requests
        without adapters pay nothing for LoRA)."""
        if not any(seq.adapter for seq in batch.seqs):
            return None
        row_slots = [seq.lora_slot if seq.adapter else -1 for seq in batch.seqs]
        assert all(seq.adapter is None or seq.lora_slot >= 0 for seq in batch.seqs), (
            "running adapter without a slot")
        if batch.num_decode == len(batch.seqs):
            token_slots = row_slots  # one token a row
        else:
            token_slots = [slot for slot, n in zip(row_slots, batch.num_new_tokens) for _ in range(n)]
        sample_slots = [token_slots[r] for r in batch.logit_rows.rows]
        used = {seq.lora_slot for seq in batch.seqs if seq.adapter}
        full = {slot: self.full.held[slot] for slot in used if self.full.holds(slot)}
        return LoRARows(token_slots, sample_slots, self.num_slots,
                        embed=not self.embed_slots.isdisjoint(used),
                        head=not self.head_slots.isdisjoint(sample_slots),
                        experts=not self.experts.held.isdisjoint(used), full=full or None)

    def table(self) -> dict:
        """What every rank must agree on about its slots: each pool's ranks and scales per slot
        (its A and B are this rank's parts, so they differ), and which slots adapt the
        vocabulary ends (a tensor-parallel worker checks its own against rank 0's after every
        change)."""
        pools = {f"layers.{index}.{linear.slice_names[0]}": linear.lora
                 for index, linear in self.linears}
        pools |= {"embed_tokens": self.embedding.lora, "lm_head": self.head.lora}
        return {"pools": {name: (lora.ranks.tolist(), lora.scales.tolist())
                          for name, lora in pools.items() if lora is not None},
                "embed": sorted(self.embed_slots), "head": sorted(self.head_slots)}

    def close(self) -> None:
        """Drop every buffer and the model's modules (device memory), e.g. when the engine
        closes."""
        for _, linear in self.linears:
            linear.lora = None
        self.embedding.lora = self.head.lora = None
        self.full.held.clear()
        self.views = None  # they hold the buffers' storage
        self.experts.close()
        self.model = self.embedding = self.head = None
        self.linears = []
