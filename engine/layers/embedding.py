"""The vocabulary ends of the model, each able to carry a per-row LoRA delta.

`VocabEmbedding` (embed_tokens): token ids -> hidden rows, plus each token's own adapter's
embedding LoRA (PEFT's lora.Embedding). `LMHead` (lm_head): final hidden rows -> logits, with
its own weight or the embedding's (tie_word_embeddings), plus each *sampling row's* adapter's
lm_head LoRA; LoRAStep.sample holds the slots of exactly those rows. A tied lm_head shares the
base weight only: its LoRA is its own, as in PEFT. The adapter manager sets `lora` to the slot
pool buffers when the first adapter that adapts the module arrives; until then, and in steps
where no row's slot adapts the module, nothing is computed for it.

An adapter may instead replace either module outright with its own saved copy (PEFT's
modules_to_save; engine/lora/full_modules.py): LoRAStep.full names those rows, which then use the
copy in place of the base weight (never both: PEFT saves no LoRA beside a saved copy).

Under tensor parallelism both are vocab-parallel (engine/distributed/shard.py): a rank holds rows
[vocab_start, vocab_start + local_vocab) of the weight (the last rank's tail is padding).
embed_tokens looks up the ids in its range, the ranks' rows are summed (all-reduce), and the
embedding LoRA and saved rows are applied to the full result, identically on every rank (their
pools are whole). lm_head computes its rows' logits, its LoRA with B split by vocabulary rows
like the weight, and the ranks' logits are gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loragw.engine.distributed import group
from loragw.engine.distributed.shard import ONE, Shard
from loragw.engine.forward.context import get_forward_context
from loragw.engine.forward.lora import embed_full_rows, head_logits
from loragw.engine.layers.linear import LoRABuffers
from loragw.engine.layers.parts import Loadable
from loragw.kernels import cpu_linear


@dataclass(slots=True)
class EmbeddingLoRABuffers:
    """embed_tokens' device slot pool (see kernels.LoRAKernels.embedding for the math)."""

    lora_a: torch.Tensor  # [S, V, R]: lora_embedding_A transposed, one row per token id
    lora_b: torch.Tensor  # [S, H, R]: lora_embedding_B
    ranks: torch.Tensor  # [1, S] int32, 0 = no embedding LoRA in that slot
    scales: torch.Tensor  # [1, S] float32

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.lora_a, self.lora_b, self.ranks, self.scales))


class VocabShard(Loadable):
    """The vocabulary rows [vocab_start, vocab_start + local_vocab) a rank holds, `real` of
    them real (the rest pad the last rank)."""

    def __init__(self, vocab_size: int, shard: Shard):
        self.vocab_size, self.shard = vocab_size, shard
        self.vocab_start, self.local_vocab, self.real = shard.padded_split(vocab_size)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a [vocab, ...] tensor, zero-padded to local_vocab rows."""
        if self.shard.size == 1:
            return full
        part = full.new_zeros((self.local_vocab, *full.shape[1:]))
        part[:self.real] = full[self.vocab_start:self.vocab_start + self.real]
        return part

    def checkpoint_part(self, slice_name: str | None, full: torch.Tensor) -> torch.Tensor:
        return self.local(full)  # [vocab, hidden] -> this rank's rows


class VocabEmbedding(nn.Module, VocabShard):
    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard = ONE):
        nn.Module.__init__(self)
        VocabShard.__init__(self, vocab_size, shard)
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden_size), requires_grad=False)
        self.lora: EmbeddingLoRABuffers | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> y: [T, H]
        if self.shard.size == 1:
            y = F.embedding(ids, self.weight)
        else:
            local = ids - self.vocab_start
            mine = (local >= 0) & (local < self.real)  # [T]
            y = F.embedding(torch.where(mine, local, 0), self.weight) * mine[:, None]
            group.all_reduce(y)
        ctx = get_forward_context()
        if ctx.lora is None:
            return y
        if ctx.lora.full is not None:
            embed_full_rows(y, ids, ctx.lora.full)
        if self.lora is not None and ctx.lora.embed:
            lora = self.lora
            ctx.backends.lora_kernels.embedding(y, ids, lora.lora_a, lora.lora_b, lora.ranks,
                                                lora.scales, ctx.lora.tokens)
        return y


class LMHead(nn.Module, VocabShard):
    def __init__(self, hidden_size: int, vocab_size: int, shard: Shard = ONE,
                 tied_to: VocabEmbedding | None = None):
        nn.Module.__init__(self)
        VocabShard.__init__(self, vocab_size, shard)
        self.hidden_size = hidden_size
        self._tied_to = (tied_to,) if tied_to is not None else ()  # a tuple: not a submodule
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden_size),
                                       requires_grad=False)
        self.lora: LoRABuffers | None = None  # one slice: lora_a [1, S, R, H], lora_b [S, V, R]
        # oneDNN's layout of the weight (kernels/cpu_linear.py), beside it: a tied weight is
        # also the embedding's, and saved full-module heads read it whole
        self.packed: torch.Tensor | None = None

    def prepack(self) -> None:
        self.packed = cpu_linear.pack(self._tied_to[0].weight if self._tied_to else self.weight)

    @property
    def tied(self) -> bool:
        return bool(self._tied_to)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [B, H], the sampling rows -> logits: [B, V] (float32 for the sampler)
        weight = self._tied_to[0].weight if self._tied_to else self.weight
        ctx = get_forward_context()
        full = ctx.lora.full if ctx.lora is not None else None
        if full is not None and full.head:
            logits = head_logits(hidden, weight, full)  # some rows on their adapter's own copy
        elif self.packed is not None:
            logits = cpu_linear.packed_linear(hidden, self.packed)
        else:
            logits = F.linear(hidden, weight)
        if self.lora is not None and ctx.lora is not None and ctx.lora.sample is not None:
            meta = ctx.lora.sample
            assert meta.num_tokens == hidden.shape[0], (
                f"lm_head LoRA metadata has {meta.num_tokens} rows, the step samples "
                f"{hidden.shape[0]}")
            self.lora.apply(logits, hidden, (0, self.local_vocab), meta,
                            ctx.backends.lora_kernels)
        if self.shard.size > 1:
            logits = group.all_gather(logits)[:, :self.vocab_size]
        return logits.float()
