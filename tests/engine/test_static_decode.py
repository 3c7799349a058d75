"""Decode steps from static buffers (engine/runner/inputs.py) and their CUDA-graph path
(engine/runner/graphs.py), on the CPU.

A CUDA graph replays the kernels it recorded over the tensors it recorded: whatever a step
changes must be written into those same tensors. `ReplayDouble` stands in for the CUDA calls
with that contract: capture keeps the forward closure of the first step of a key (bound to
that step's objects), replay calls that closure again and copies its result into the captured
output. A forward that read anything but the decode buffers and the captured LoRA meta (a
fresh tensor, a host value of the current step) would replay the first step's inputs and
produce other tokens than eager decoding; so would a row padded into a real sequence's KV
blocks.
"""

from __future__ import annotations

import pytest
from peft_reference import MAX_TOKENS, World

from loragw.engine import SamplingParams
from loragw.engine.runner.graphs import DecodeGraphs, GraphKey, graph_buckets

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


class ReplayDouble(DecodeGraphs):
    """DecodeGraphs with the CUDA calls replaced by a replay of the captured closure."""

    def __init__(self, buckets: list[int]):
        super().__init__(buckets)
        self.replays: dict[GraphKey, int] = {}

    def _new_pool(self):
        return None

    def _capture(self, forward):
        return forward, forward()

    def _replay(self, graph) -> None:
        key = next(k for k, (g, _) in self.graphs.items() if g is graph)
        self.replays[key] = self.replays.get(key, 0) + 1
        self.graphs[key][1].copy_(graph())


def with_replay_graphs(llm) -> ReplayDouble:
    runner = llm.engine.runner
    runner.graphs = ReplayDouble(graph_buckets(llm.engine.config.max_num_seqs))
    runner.capture_graphs()
    return runner.graphs


def staggered(n: int) -> list[SamplingParams]:
    """Requests that finish at different steps, so decode batches shrink through the buckets."""
    return [SamplingParams(max_tokens=MAX_TOKENS - i % 5, temperature=0.0, ignore_eos=True)
            for i in range(n)]


def test_graph_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(6) == [1, 2, 4, 6]
    assert graph_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_buckets(30) == [1, 2, 4, 8, 16, 24, 30]


def test_decode_steps_read_one_set_of_buffers(lora_world: World):
    """Every decode-only step's token ids, positions and LoRA meta are the same tensors,
    refilled in place; no graph on the CPU."""
    llm = lora_world.llm()
    runner = llm.engine.runner
    assert runner.graphs is None
    seen: set[tuple[int, int, int]] = set()
    forward = runner.forward

    def spy(inputs):
        if inputs.decode is not None:
            meta = inputs.lora.tokens.packed.data_ptr() if inputs.lora else 0
            seen.add((inputs.input_ids.data_ptr(), inputs.positions.data_ptr(), meta))
        return forward(inputs)

    runner.forward = spy
    requests = [a for a in lora_world.requests if a is not None]
    outputs = llm.generate([lora_world.prompts[i] for i, a in enumerate(lora_world.requests)
                            if a is not None], GREEDY, adapters=requests)
    buffers = runner.decode_buffers
    assert {s[:2] for s in seen} == {(buffers.dev64[0].data_ptr(), buffers.dev64[1].data_ptr())}
    assert len({s[2] for s in seen}) == 1, "one decode LoRA meta for one batch size"
    wanted = [e for e, a in zip(lora_world.expected, lora_world.requests) if a is not None]
    assert [out.token_ids for out in outputs] == wanted


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_graph_replay_is_token_identical_to_eager(lora_world: World, backend):
    """Replayed decode steps, padded to 1/2/4/6 rows, with adapters and base rows mixed,
    give PEFT's tokens; the padding rows write only the padding block."""
    llm = lora_world.llm(lora_backend=backend, attention_backend=backend, max_num_seqs=6)
    graphs = with_replay_graphs(llm)
    runner = llm.engine.runner
    steps: list[tuple[int, int]] = []  # (graph rows, real rows) of every replayed step
    forward = runner.forward

    def spy(inputs):
        if inputs.graph is not None:
            steps.append((inputs.graph.rows, inputs.decode.real))
        return forward(inputs)

    runner.forward = spy
    assert {k.rows for k in graphs.graphs} == {1, 2, 4, 6}
    n = len(lora_world.requests)
    outputs = llm.generate(lora_world.prompts, staggered(n), adapters=lora_world.requests)
    for i, (out, want) in enumerate(zip(outputs, lora_world.expected, strict=True)):
        assert out.token_ids == want[:len(out.token_ids)], f"request {i}"
    assert sum(v for k, v in graphs.replays.items() if k.lora) > 0, graphs.replays
    assert any(rows > real for rows, real in steps), f"no padded step: {steps}"
    pad = runner.num_kv_blocks
    assert llm.engine.block_manager.num_blocks == pad, "the padding block is never handed out"
    assert llm.engine.num_free_kv_blocks == llm.engine.block_manager.num_blocks


def test_enforce_eager_changes_nothing_on_the_cpu(lora_world: World):
    llm = lora_world.llm(enforce_eager=True)
    assert llm.engine.runner.graphs is None
    outputs = llm.generate(lora_world.prompts, GREEDY, adapters=lora_world.requests)
    lora_world.check(outputs, "--enforce-eager")


def test_steps_past_the_largest_bucket_or_with_embedding_loras_run_eagerly():
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.buckets = [1, 2, 4, 8]
    assert graphs.key_for(9, None) is None
    assert graphs.key_for(3, None) == GraphKey(4, False)

    class Step:
        embed, full, experts = True, None, False

    assert graphs.key_for(3, Step()) is None
    Step.embed = False
    assert graphs.key_for(5, Step()) == GraphKey(8, True)
    Step.experts = True  # expert LoRA picks its rows on the host: eager
    assert graphs.key_for(5, Step()) is None
