"""The tensors one forward pass reads, built by the model runner once per step.

A decode-only step (every row one new token: the steady state of serving) is written into
`DecodeBuffers`: host arrays preallocated for `max_num_seqs` rows and filled in place, copied
to their device twins in two copies (none on the CPU, where host and device are one tensor).
The forward pass reads only views of those buffers and what it derives from them on the
device, so the same code is what a CUDA graph captures and replays (engine/runner/graphs.py).
Steps with prefill rows build fresh tensors: they are compute-bound, and their shapes vary.

Decode buffers, N = max_num_seqs rows, W = blocks of a max_model_len sequence:
    ids64   [3, N] int64: token id, position, KV slot of each row
    ids32   [N + N * W] int32: context length of each row, then the block tables, packed as
            [rows, width] (width: the step's longest table, or W under a graph)
The tables are kept in a host grid [N, W] whose rows are rewritten only when they changed since
the step before (a new block every block_size steps, another sequence in the row), and packed
from it by one array copy: converting every row's whole table from Python each step was most of
a large batch's input preparation.
Rows past a step's own (graph padding) decode one dummy token into the padding block, a KV
block the block manager never hands out, so they never touch a sequence's cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from loragw.engine.forward.context import AttentionMetadata, DecodeChunk
from loragw.engine.forward.lora import LoRAStep
from loragw.engine.runner.graphs import GraphKey
from loragw.engine.sched.batch import LogitRows


@dataclass(slots=True)
class DecodeViews:
    """Views of DecodeBuffers for one decode-only step of `rows` rows (`real` of them a
    sequence's, the rest graph padding)."""

    input_ids: Tensor  # [rows] int64
    positions: Tensor  # [rows] int64
    slot_mapping: Tensor  # [rows] int64
    context_lens: Tensor  # [rows] int32: tokens in cache after this step
    block_tables: Tensor  # [rows, width] int32, stale past a row's own blocks (never read)
    real: int


@dataclass(slots=True)
class StepInputs:
    input_ids: Tensor  # [T] int64
    positions: Tensor  # [T] int64
    attn: AttentionMetadata | None  # None when a graph derives it from `decode` on replay
    lora: LoRAStep | None
    logits: LogitRows  # StepPlan.logit_rows
    decode: DecodeViews | None = None  # a decode-only step: what attn is derived from
    graph: GraphKey | None = None  # the CUDA graph that runs the step, if one does


def decode_metadata(views: DecodeViews, attention_backend: str, block_size: int,
                    kv_token_bytes: int | None = None) -> AttentionMetadata:
    """The attention metadata of a decode-only step, derived on the device from its buffers
    (no host data: a captured graph recomputes it on replay). kv_token_bytes (K and V of one
    token in one layer), on the CPU only: also plan the torch path's chunks (decode_chunks)."""
    rows, width = views.block_tables.shape
    block_ids = mask = chunks = None
    if attention_backend == "torch":  # the batched SDPA path gathers whole blocks under a mask
        block_ids = views.block_tables.reshape(-1).long()  # [rows * width]
        positions = torch.arange(width * block_size, device=block_ids.device)  # [L]
        mask = (positions[None, :] < views.context_lens[:, None])[:, None, None, :]  # [rows, 1, 1, L]
        if kv_token_bytes is not None:
            chunks = decode_chunks(views, block_size, kv_token_bytes)
    return AttentionMetadata(
        slot_mapping=views.slot_mapping, num_decode_tokens=rows,
        decode_block_tables=views.block_tables, decode_context_lens=views.context_lens,
        decode_block_ids=block_ids, decode_mask=mask, prefill_query_starts=[],
        prefill_query_lens=[], prefill_context_lens=[], prefill_block_tables=[],
        decode_chunks=chunks)


# K and V bytes one chunk of decode rows gathers: small enough that SDPA reads them back from
# the cache the gather just wrote them to, not from DRAM. One gather of every row at the longest
# width costs 2x at 32 rows of 320 tokens (6.4 vs 3.4 ms a layer on a 2-core AVX-512 EPYC with
# a 32 MiB L3), and sorting rows by length first also drops most of the padding.
DECODE_CHUNK_BYTES = 6 * 2**20


def decode_chunks(views: DecodeViews, block_size: int, kv_token_bytes: int) -> list[DecodeChunk]:
    """The decode rows sorted by context length and cut into chunks of at most
    DECODE_CHUNK_BYTES of gathered K/V (at least one row each), each at its own width."""
    lens = views.context_lens.tolist()
    order = sorted(range(len(lens)), key=lens.__getitem__)
    widths = [-(-lens[i] // block_size) for i in order]  # blocks, ascending
    block_bytes = block_size * kv_token_bytes
    chunks, start = [], 0
    while start < len(order):
        end = start + 1  # a chunk is as wide as its last (longest) row
        while end < len(order) and (end + 1 - start) * widths[end] * block_bytes <= DECODE_CHUNK_BYTES:
            end += 1
        rows = torch.tensor(order[start:end], dtype=torch.int64)
        width = widths[end - 1]
        tables = views.block_tables.index_select(0, rows)[:, :width]  # [n, w]
        positions = torch.arange(width * block_size)
        mask = positions[None, :] < views.context_lens.index_select(0, rows)[:, None]
        chunks.append(DecodeChunk(rows, tables.reshape(-1).long(), mask[:, None, None, :]))
        start = end
    return chunks


class DecodeBuffers:
    def __init__(self, max_rows: int, max_blocks: int, block_size: int, pad_block: int,
                 device: torch.device):
        self.max_rows, self.max_blocks, self.block_size = max_rows, max_blocks, block_size
        self.pad_block = pad_block
        pinned = device.type == "cuda"  # so the copies run asynchronously
        self.host64 = torch.zeros(3, max_rows, dtype=torch.int64, pin_memory=pinned)
        self.host32 = torch.zeros(max_rows * (1 + max_blocks), dtype=torch.int32, pin_memory=pinned)
        self.np64, self.np32 = self.host64.numpy(), self.host32.numpy()
        self.grid = np.zeros((max_rows, max_blocks), dtype=np.int32)  # each row's table
        self.written: list[list[int]] = [[] for _ in range(max_rows)]  # each row's, as in grid
        self.row_ids = np.arange(max_rows)
        # (rows, width) -> the device views of a step of that shape (a slice of a tensor costs
        # microseconds, and these are the same tensors every step)
        self.views: dict[tuple[int, int], tuple[Tensor, ...]] = {}
        same = device.type == "cpu"
        self.dev64 = self.host64 if same else torch.zeros_like(self.host64, device=device)
        self.dev32 = self.host32 if same else torch.zeros_like(self.host32, device=device)
        # The last step's copies out of the host buffers: under async scheduling the host fills
        # them again while that step may still be queued, so it waits for those copies first.
        self.copied = None if same else torch.cuda.Event()

    def fill(self, positions: list[int], tokens: list[int], tables: list[list[int]], rows: int,
             width: int | None = None) -> DecodeViews:
        """Write single-query rows (a token at a position, with its sequence's block table),
        padded to `rows` rows, with block tables `width` wide (default: the longest table).
        Returns the device views."""
        real, size, N = len(positions), self.block_size, self.max_rows
        assert real <= rows <= N, f"{real} sequences in a step of {rows} rows (at most {N})"
        width = width or max(map(len, tables))
        if self.copied is not None:
            self.copied.synchronize()
        grid, written = self.grid, self.written
        for i, table in enumerate(tables):
            if table != written[i]:  # a new block, or another sequence (a list compare: cheap)
                grid[i, :len(table)] = table
                written[i] = table.copy()
        for i in range(real, rows):  # graph padding: the padding block
            if written[i] != [self.pad_block]:
                grid[i, 0], written[i] = self.pad_block, [self.pad_block]
        # (comprehensions and whole-array arithmetic: this runs for every row of every step)
        np64 = self.np64
        np64[0, :real] = tokens
        np64[1, :real] = positions
        blocks = grid[self.row_ids[:real], np64[1, :real] // size]  # each row's block
        np64[2, :real] = blocks * size + np64[1, :real] % size  # its slot
        self.np32[:real] = np64[1, :real] + 1  # context lengths
        np64[:2, real:rows] = 0
        np64[2, real:rows] = self.pad_block * size
        self.np32[real:rows] = 1
        self.np32[N:N + rows * width].reshape(rows, width)[:] = grid[:rows, :width]
        if self.dev64 is not self.host64:
            self.dev64[:, :rows].copy_(self.host64[:, :rows], non_blocking=True)
            self.dev32[:N + rows * width].copy_(self.host32[:N + rows * width], non_blocking=True)
            self.copied.record()
        views = self.views.get((rows, width))
        if views is None:
            views = self.views[rows, width] = (
                self.dev64[0, :rows], self.dev64[1, :rows], self.dev64[2, :rows],
                self.dev32[:rows], self.dev32[N:N + rows * width].view(rows, width))
        return DecodeViews(*views, real)
