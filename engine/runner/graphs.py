"""CUDA graphs of the decode forward pass: every layer's kernels launched by one replay.

At batch 32 a decode step launches ~20 kernels a layer from Python; on a GPU that host time
exceeds the device time of a small model's step. A graph records the launches of one forward
pass over the decode buffers (engine/runner/inputs.py) and replays them with whatever those
buffers hold, so a step costs one launch.

What is captured, per (rows, lora) key:
    rows  a bucket of 1, 2, 4, 8, then every 8 up to max_num_seqs (vLLM's sizes); a step
          pads its rows to the smallest bucket that holds them (padding rows decode a dummy
          token into the padding KV block)
    lora  whether the projections run their LoRA kernels: the Triton kernels read the slot of
          every row from the captured LoRAMeta, so one graph serves every mix of adapters
          (rows without an adapter have slot -1, which the kernels skip)
The forward pass ends at the final norm: lm_head (with its LoRA, saved modules, prompt
logprobs), grammar masks and sampling run eagerly on the rows that need them. Steps the
graphs cannot replay run eagerly over the same buffers: more rows than the largest bucket,
an embed_tokens LoRA or a saved module in some row (their rows are picked on the host).

Graphs need the Triton backends for decode attention and LoRA (the torch paths pick their
work on the host), a CUDA device, and no --enforce-eager. The graphs without LoRA are
captured at start-up; those with LoRA when the first adapter step of their bucket runs, since
the adapter slot pools are allocated with the first adapter. All share one memory pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loragw.engine.forward.backends import Backends
from loragw.engine.forward.lora import LoRARows

logger = logging.getLogger(__name__)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Row counts that get a graph: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs (included)."""
    sizes = [n for n in (1, 2, 4) if n < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted({*sizes, max_num_seqs})


def graphs_off_reason(device: torch.device, enforce_eager: bool, backends: Backends) -> str | None:
    """Why this engine runs decode eagerly, or None when it captures graphs."""
    if enforce_eager:
        return "--enforce-eager"
    if device.type != "cuda":
        return f"the device is {device.type}"
    if backends.attention != "triton" or backends.lora != "triton":
        return (f"decode attention on {backends.attention} and LoRA on {backends.lora}: graphs "
                "need the Triton kernels for both")
    return None


@dataclass(frozen=True, slots=True)
class GraphKey:
    rows: int
    lora: bool


class DecodeGraphs:
    def __init__(self, buckets: list[int]):
        self.buckets = sorted(buckets)
        self.graphs: dict[GraphKey, tuple[object, torch.Tensor]] = {}  # key -> (graph, hidden)
        self.pool = self._new_pool()

    def key_for(self, rows: int, lora: LoRARows | None) -> GraphKey | None:
        """The graph that serves a decode-only step of `rows` rows, None if none can."""
        if rows > self.buckets[-1]:
            return None
        if lora is not None and (lora.embed or lora.full is not None or lora.experts):
            return None  # their rows are picked on the host, step by step
        bucket = next(b for b in self.buckets if b >= rows)
        return GraphKey(bucket, lora is not None)

    def run(self, key: GraphKey, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Replay `key`'s graph, capturing it from `forward` first if it is new. `forward`
        reads only the decode buffers (already filled for this step) and returns the final
        hidden states [rows, hidden]; the returned tensor is the graph's own output buffer,
        valid until the next replay."""
        if key not in self.graphs:
            self.capture(key, forward)
        graph, hidden = self.graphs[key]
        self._replay(graph)
        return hidden

    def capture(self, key: GraphKey, forward: Callable[[], torch.Tensor]) -> None:
        started = time.perf_counter()
        forward()  # warm-up: compiles the kernels and fills every cache a launch reads
        graph, hidden = self._capture(forward)
        self.graphs[key] = (graph, hidden)
        logger.debug("captured the decode graph of %d rows%s in %.0f ms", key.rows,
                     " with LoRA" if key.lora else "", (time.perf_counter() - started) * 1e3)

    # ---- the CUDA calls (a CPU test double overrides these three) --------------------------
    def _new_pool(self):
        return torch.cuda.graph_pool_handle()

    def _capture(self, forward: Callable[[], torch.Tensor]):
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = forward()
        return graph, hidden

    def _replay(self, graph) -> None:
        graph.replay()
