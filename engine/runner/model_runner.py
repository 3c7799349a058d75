"""Owns the model and its KV cache; turns a scheduled batch into logits.

Per step, `prepare` builds the step's inputs from its StepPlan (engine/sched/plan.py, the same
on every tensor-parallel rank) into engine/runner/inputs.py's: the flat token batch (decode rows
first, then prefill chunks), the KV slot of every new token, the block tables attention reads,
and the LoRAStep of the slot pool's LoRARows (engine/forward/lora.py); `forward` runs one
forward pass (a CUDA graph replay for decode-only steps when graphs are on:
engine/runner/graphs.py) and computes logits only for the rows that need them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from loragw.engine.config import Config
from loragw.engine.distributed.shard import ONE, Shard
from loragw.engine.forward.backends import attention_shape, quant_kind, resolve_backends
from loragw.engine.forward.context import AttentionMetadata, ForwardContext, forward_context
from loragw.engine.forward.lora import LoRAStep
from loragw.engine.models.loader import load_model
from loragw.engine.runner.graphs import DecodeGraphs, GraphKey, graph_buckets, graphs_off_reason
from loragw.engine.runner.host_memory import keep_freed_memory
from loragw.engine.runner.inputs import DecodeBuffers, DecodeViews, StepInputs, decode_metadata
from loragw.engine.sched.batch import PromptRows
from loragw.engine.sched.pipeline import PendingInputs
from loragw.engine.sched.plan import StepPlan
from loragw.kernels import LoRAMeta
from loragw.kernels.meta import host_to_device

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepLogits:
    logits: torch.Tensor  # [L, vocab] float32: the step's logit rows, in batch order
    sampling: list[int]  # the rows of `logits` that sample, one per sampling sequence, in order
    prompt: list[PromptRows]


class ModelRunner:
    def __init__(self, config: Config, shard: Shard = ONE):
        """shard: this rank's part of the model under tensor parallelism (engine/distributed)."""
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        if self.device.type == "cpu":
            keep_freed_memory()  # a step's large transients reuse pages (engine/runner/host_memory.py)
        self.model = load_model(config.model, config.args, self.dtype, self.device, shard,
                                config.quant)
        self.args = self.model.args
        attn = self.model.attention_layers()[0]
        self.heads = attention_shape(self.model.attention_layers())  # this rank's
        self.num_kv_blocks = config.num_kv_blocks or self._size_kv_cache(config)
        # One block more than the block manager hands out: graph padding rows write there.
        shape = (self.num_kv_blocks + 1, self.block_size, attn.num_kv_heads, attn.head_dim)
        for attn in self.model.attention_layers():
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.model.model.rotary_emb.reserve(config.max_model_len)
        # Every layer slides: blocks before the window are freed (engine/kv/block_manager.py).
        self.kv_window = kv_window(self.model.attention_layers())
        self.backends = resolve_backends(
            config.lora_backend, config.attention_backend, self.device, self.dtype,
            self.heads, quant_kind(self.model), config.linear_backend,
            config.elementwise_backend)
        if self.backends.linear == "onednn":  # before the log line: weight bytes as held
            self.model.prepack(every=config.linear_backend == "onednn")
        self.max_blocks = -(-config.max_model_len // self.block_size)  # of one sequence
        # the torch decode path's chunks are sized by this on the CPU (step_inputs.decode_chunks)
        self.kv_token_bytes = (self.bytes_per_block // (self.args.num_layers * self.block_size)
                               if self.device.type == "cpu" else None)
        spec = config.speculative  # a verifying row attends as 1 + k single-query rows
        query_rows = config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
        self.decode_buffers = DecodeBuffers(query_rows, self.max_blocks, self.block_size,
                                            pad_block=self.num_kv_blocks, device=self.device)
        self._metas: dict[tuple[int, int], LoRAMeta] = {}  # (rows, slots) -> decode LoRA meta
        off = graphs_off_reason(self.device, config.enforce_eager, self.backends)
        self.graphs = DecodeGraphs(graph_buckets(config.max_num_seqs)) if off is None else None
        logger.info("weights: %.1f MiB%s; KV cache: %d blocks of %d tokens (%.1f MiB); LoRA on "
                    "%s, decode attention on %s, projections on %s, norms and rotary on %s; "
                    "decode %s",
                    self.model.weight_bytes() / 2**20,
                    f" ({config.quant.method}, GEMM on {self.backends.quant})"
                    if config.quant else "", self.num_kv_blocks, self.block_size,
                    self.kv_cache_bytes / 2**20, self.backends.lora, self.backends.attention,
                    self.backends.linear, self.backends.elementwise,
                    f"eager ({off})" if off else "in CUDA graphs")
        if self.graphs is not None:
            self.capture_graphs()

    def close(self) -> None:
        """Drop the model, its KV cache and the decode graphs and buffers (what holds device
        memory); the runner runs nothing after."""
        self.model = self.graphs = self.decode_buffers = None
        self._metas.clear()

    @property
    def bytes_per_block(self) -> int:
        a = self.args
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * a.num_layers * self.block_size * self.heads.num_kv_heads * a.head_dim * element

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

    # ---- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, plan: StepPlan, pending: PendingInputs | None = None) -> StepLogits:
        """Forward one step; the logits of its logit rows (plan.logit_rows: the rows that
        sample, and those whose prompt logprobs were asked for). `pending`: input tokens the
        step in flight samples (async scheduling, engine/sched/pipeline.py)."""
        return self.forward(self.prepare(plan, pending))

    def prepare(self, plan: StepPlan, pending: PendingInputs | None = None) -> StepInputs:
        inputs = self._prepare(plan)
        if pending is not None:  # the host wrote placeholders there: the device has the tokens
            pending.write(inputs.input_ids)
        return inputs

    def _prepare(self, plan: StepPlan) -> StepInputs:
        logits = plan.logit_rows
        if plan.decode_only:
            return self._prepare_decode(plan)
        positions, slots, size = [], [], self.block_size
        for start, n, table in zip(plan.starts, plan.num_new, plan.block_tables):
            positions.extend(range(start, start + n))
            slots.extend(table[p // size] * size + p % size for p in range(start, start + n))
        # Single-query attention rows: the decode rows, then each token of a row verifying
        # drafts (a few tokens on a long context: the decode kernel per token beats a prefill's
        # gather): the step's first `queries` tokens. Prefill chunks follow them.
        single = plan.num_decode + plan.num_drafted
        queries = sum(plan.num_new[:single])
        prefill_starts, offset = [], queries
        for n in plan.num_new[single:]:
            prefill_starts.append(offset)
            offset += n
        rows = host_to_device([plan.tokens, positions, slots], self.device)
        attn = AttentionMetadata(
            slot_mapping=rows[2], num_decode_tokens=queries, decode_block_tables=None,
            decode_context_lens=None, decode_block_ids=None, decode_mask=None,
            prefill_query_starts=prefill_starts, prefill_query_lens=plan.num_new[single:],
            prefill_context_lens=[s + n for s, n in zip(plan.starts[single:],
                                                        plan.num_new[single:])],
            prefill_block_tables=[host_to_device(t, self.device)
                                  for t in plan.block_tables[single:]])
        if queries:  # the single-query rows' addressing, in the decode buffers
            tables = [t for t, n in zip(plan.block_tables[:single], plan.num_new) for _ in range(n)]
            views = self.decode_buffers.fill(positions[:queries], plan.tokens[:queries], tables,
                                             queries)
            meta = decode_metadata(views, self.backends.attention, self.block_size,
                                   self.kv_token_bytes)
            attn.decode_block_tables, attn.decode_context_lens = meta.decode_block_tables, meta.decode_context_lens
            attn.decode_block_ids, attn.decode_mask = meta.decode_block_ids, meta.decode_mask
            attn.decode_chunks = meta.decode_chunks
        lora = LoRAStep.build(plan.lora, self.device) if plan.lora is not None else None
        return StepInputs(rows[0], rows[1], attn, lora, logits)

    def _prepare_decode(self, plan: StepPlan) -> StepInputs:
        """A decode-only step, in the decode buffers (padded to its graph's rows)."""
        real = len(plan.starts)
        key = self.graphs.key_for(real, plan.lora) if self.graphs is not None else None
        rows, width = (key.rows, self.max_blocks) if key else (real, None)
        views = self.decode_buffers.fill(plan.starts, plan.tokens, plan.block_tables, rows, width)
        lora = None
        if plan.lora is not None:
            lora = LoRAStep.build(plan.lora, self.device, pad_to=rows,
                                  out=self._decode_meta(rows, plan.lora.num_slots))
        attn = None if key else decode_metadata(views, self.backends.attention, self.block_size,
                                                self.kv_token_bytes)
        return StepInputs(views.input_ids, views.positions, attn, lora, plan.logit_rows, views,
                          key)

    def _decode_meta(self, rows: int, num_slots: int) -> LoRAMeta:
        """The LoRA meta of decode steps of `rows` rows, refilled in place every step."""
        key = (rows, num_slots)
        if key not in self._metas:
            self._metas[key] = LoRAMeta.empty(rows, num_slots, self.device)
        return self._metas[key]

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> StepLogits:
        ctx = ForwardContext(attn=inputs.attn, lora=inputs.lora, backends=self.backends)
        if inputs.graph is not None:
            hidden = self.graphs.run(inputs.graph, lambda: self._decode_forward(inputs.decode,
                                                                                inputs.lora))
            hidden = hidden[:inputs.decode.real]
        else:
            with forward_context(ctx):
                hidden = self.model(inputs.input_ids, inputs.positions)  # [T, hidden]
        wanted = inputs.logits
        if not wanted.rows:
            return StepLogits(hidden.new_empty((0, self.args.vocab_size), dtype=torch.float32),
                              [], [])
        if len(wanted.rows) < hidden.shape[0]:  # else every row: no gather
            hidden = hidden[host_to_device(wanted.rows, self.device)]
        with forward_context(ctx):  # lm_head's LoRA and saved copies read the step's rows
            return StepLogits(self.model.compute_logits(hidden), wanted.sampling, wanted.prompt)

    def _decode_forward(self, views: DecodeViews, lora: LoRAStep | None) -> torch.Tensor:
        """The forward pass of a decode step from its buffers alone: what a graph captures."""
        attn = decode_metadata(views, self.backends.attention, self.block_size)
        with forward_context(ForwardContext(attn=attn, lora=lora, backends=self.backends)):
            return self.model(views.input_ids, views.positions)  # [rows, hidden]

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """The decode graphs without LoRA, largest first (the smaller reuse its memory)."""
        started = time.perf_counter()
        for rows in reversed(self.graphs.buckets):
            views = self.decode_buffers.fill([], [], [], rows, self.max_blocks)  # padding only
            self.graphs.capture(GraphKey(rows, False), lambda v=views: self._decode_forward(v, None))
        logger.info("captured %d decode graphs (1 to %d rows) in %.1f s",
                    len(self.graphs.buckets), self.graphs.buckets[-1],
                    time.perf_counter() - started)


def kv_window(layers) -> int | None:
    """The window every layer's attention stays within (the widest), or None if some layer
    sees its whole context."""
    windows = [layer.sliding_window for layer in layers]
    return None if None in windows else max(windows)


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30
