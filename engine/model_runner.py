"""Owns the model and its KV cache; turns a scheduled batch into logits.

Per step it builds the flat token batch (decode rows first, then prefill chunks), the KV
slot of every new token and the block tables attention reads, then runs one forward pass and
computes logits only for rows that sample. With LoRA the adapter manager's LoRAStep gives the
slot of every token and, for lm_head, of every sampling row (in the order built here).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.backends import AttentionShape, resolve_backends
from engine.config import Config
from engine.forward_context import AttentionMetadata, ForwardContext, LoRAStep, forward_context
from engine.loader import load_model
from engine.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PromptRows:
    """Logit rows of one sequence that give prompt logprobs: rows [first, first + count) of
    StepLogits.logits hold positions [position, position + count), each the logprob of the
    prompt token after it."""

    batch_row: int  # the sequence's index in the batch
    first: int
    position: int
    count: int


@dataclass(slots=True)
class StepLogits:
    logits: torch.Tensor  # [L, vocab] float32: the step's logit rows, in batch order
    sampling: list[int]  # the rows of `logits` that sample, one per sampling sequence, in order
    prompt: list[PromptRows]


class ModelRunner:
    def __init__(self, config: Config):
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.model = load_model(config.model, config.hf_config, self.dtype, self.device)
        self.args = self.model.args
        self.num_kv_blocks = config.num_kv_blocks or self._size_kv_cache(config)
        shape = (self.num_kv_blocks, self.block_size, self.args.num_kv_heads, self.args.head_dim)
        for attn in self.model.attention_layers():
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.backends = resolve_backends(
            config.lora_backend, config.attention_backend, self.device, self.dtype,
            AttentionShape(self.args.num_heads, self.args.num_kv_heads, self.args.head_dim))
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB); LoRA on %s, decode attention "
                    "on %s", self.num_kv_blocks, self.block_size, self.kv_cache_bytes / 2**20,
                    self.backends.lora, self.backends.attention)

    @property
    def bytes_per_block(self) -> int:
        a = self.args
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * a.num_layers * self.block_size * a.num_kv_heads * a.head_dim * element

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_kv_blocks * self.bytes_per_block

    def _size_kv_cache(self, config: Config) -> int:
        """Enough blocks for max_num_seqs full-length sequences, capped by free memory less
        what the full-module slots may take (two [vocab, hidden] copies each)."""
        wanted = config.max_num_seqs * -(-config.max_model_len // self.block_size)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            free = _available_host_memory()
        element = torch.empty((), dtype=self.dtype).element_size()
        free -= config.max_full_module_slots * 2 * self.args.vocab_size * self.args.hidden_size * element
        affordable = int(max(free, 0) * config.kv_cache_memory_fraction) // self.bytes_per_block
        blocks = min(wanted, affordable)
        if blocks < -(-config.max_model_len // self.block_size):
            raise ValueError(f"only {blocks} KV blocks fit in memory, fewer than one "
                             f"max_model_len={config.max_model_len} sequence needs; lower "
                             "max_model_len or set num_kv_blocks")
        return blocks

    def _decode_addressing(self, tables: list[list[int]], context_lens: list[int]):
        """The decode rows' KV addressing, built once per step and shared by all layers:
        (block_tables [B, max_blocks] int32, context_lens [B] int32) for the Triton kernel, and
        (block_ids [B * max_blocks] int64, mask [B, 1, 1, L = max_blocks * block_size] bool) for
        the torch path, or None, None when decode attention runs on Triton."""
        blocks = _pad(tables, self.device)  # [B, max_blocks] int32
        lens = torch.tensor(context_lens, dtype=torch.int32, device=self.device)  # [B]
        if self.backends.attention != "torch":
            return blocks, lens, None, None
        positions = torch.arange(blocks.shape[1] * self.block_size, device=self.device)
        mask = (positions[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
        return blocks, lens, blocks.flatten().long(), mask

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, lora: LoRAStep | None = None) -> StepLogits:
        """Forward one batch; the logits of its logit rows (batch.logit_range: the rows that
        sample, and those whose prompt logprobs were asked for). `lora`: LoRAManager.prepare
        (batch), None when no row has an adapter."""
        input_ids, positions, slots, logit_rows, sampling, prompt = [], [], [], [], [], []
        prefill_starts, prefill_lens, prefill_ctx, prefill_tables = [], [], [], []
        decode_tables, decode_ctx = [], []
        row = 0
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            end = start + num_new
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // self.block_size] * self.block_size + p % self.block_size
                         for p in range(start, end))
            if i < batch.num_decode:
                decode_tables.append(table)
                decode_ctx.append(end)
            else:
                prefill_starts.append(row)
                prefill_lens.append(num_new)
                prefill_ctx.append(end)
                prefill_tables.append(torch.tensor(table, dtype=torch.long, device=self.device))
            wanted = batch.logit_range(i)
            if wanted:
                if seq.needs_prompt_logprobs:  # every wanted row but a sampling one
                    count = len(wanted) - batch.samples(i)
                    prompt.append(PromptRows(i, len(logit_rows), start + wanted.start, count))
                logit_rows.extend(row + o for o in wanted)
                if batch.samples(i):
                    sampling.append(len(logit_rows) - 1)
            row += num_new

        to_device = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)
        block_tables, context_lens, block_ids, mask = (
            self._decode_addressing(decode_tables, decode_ctx) if decode_tables
            else (None, None, None, None))
        attn = AttentionMetadata(
            slot_mapping=to_device(slots),
            num_decode_tokens=batch.num_decode,
            decode_block_tables=block_tables,
            decode_context_lens=context_lens,
            decode_block_ids=block_ids,
            decode_mask=mask,
            prefill_query_starts=prefill_starts,
            prefill_query_lens=prefill_lens,
            prefill_context_lens=prefill_ctx,
            prefill_block_tables=prefill_tables,
        )
        ctx = ForwardContext(attn=attn, lora=lora, backends=self.backends)
        with forward_context(ctx):
            hidden = self.model(to_device(input_ids), to_device(positions))  # [T, hidden]
            if not logit_rows:
                return StepLogits(hidden.new_empty((0, self.args.vocab_size),
                                                   dtype=torch.float32), [], [])
            if len(logit_rows) < len(input_ids):  # else every row: no gather
                hidden = hidden[to_device(logit_rows)]
            return StepLogits(self.model.compute_logits(hidden), sampling, prompt)  # [L, V]


def _pad(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.int32, device=device)  # [B, max_blocks]


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30
