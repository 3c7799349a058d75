"""CUDA-graph decode on a GPU: replayed steps give the tokens eager steps give, token for
token, with LoRA in mixed batches, base rows, token masks (allowed_token_ids, logit_bias) and
batches that shrink through the buckets, with and without async scheduling. Run by
benchmarks/gpu_session.sh on a CUDA machine; on a machine without CUDA these tests are skipped
(marked gpu)."""

from __future__ import annotations

import pytest
import torch
from peft_reference import MAX_TOKENS, World

from loragw.engine import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def mixed_params(n: int) -> list[SamplingParams]:
    """Greedy requests ending at different steps; every third masks or biases the vocab."""
    params = []
    for i in range(n):
        extra = {}
        if i % 3 == 1:
            extra = dict(allowed_token_ids=list(range(0, 200, 3)))
        elif i % 3 == 2:
            extra = dict(logit_bias={5: 3.0, 17: -100.0})
        params.append(SamplingParams(max_tokens=MAX_TOKENS - i % 5, temperature=0.0,
                                     ignore_eos=True, logprobs=2, **extra))
    return params


def run(world: World, dtype: str, eager: bool):
    llm = world.llm(device="cuda", dtype=dtype, lora_backend="triton",
                    attention_backend="triton", max_num_seqs=8, enforce_eager=eager)
    runner = llm.engine.runner
    replays = []
    if not eager:
        assert runner.graphs is not None, "CUDA graphs are off on a CUDA device"
        replay = runner.graphs._replay
        runner.graphs._replay = lambda graph: (replays.append(graph), replay(graph))
    else:
        assert runner.graphs is None
    n = len(world.requests)
    prompts = world.prompts * 2  # more rows than one bucket: 2 * n requests, max 8 at a time
    adapters = world.requests * 2
    outputs = llm.generate(prompts, mixed_params(2 * n), adapters=adapters)
    assert llm.engine.num_free_kv_blocks == llm.engine.block_manager.num_blocks
    return outputs, len(replays), {k.rows for k in (runner.graphs.graphs if runner.graphs else {})}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_matches_eager_token_for_token(lora_world: World, dtype):
    graphed, replays, captured = run(lora_world, dtype, eager=False)
    eager, _, _ = run(lora_world, dtype, eager=True)
    assert replays > 0 and {1, 2, 4, 8} <= captured, (replays, captured)
    for i, (g, e) in enumerate(zip(graphed, eager, strict=True)):
        assert g.token_ids == e.token_ids, f"request {i} (adapter {lora_world.requests[i % 6]})"
        for a, b in zip(g.logprobs, e.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-3, f"request {i}"


def test_graphs_in_float32_give_peft_tokens(lora_world: World):
    """float32 on the GPU, graphs on: PEFT's (CPU float32) greedy tokens."""
    llm = lora_world.llm(device="cuda", dtype="float32", lora_backend="triton",
                         attention_backend="triton")
    assert llm.engine.runner.graphs is not None
    outputs = llm.generate(lora_world.prompts, SamplingParams(max_tokens=MAX_TOKENS,
                           temperature=0.0, ignore_eos=True), adapters=lora_world.requests)
    lora_world.check(outputs, "cuda float32 with graphs")


def test_async_scheduling_on_the_gpu_gives_the_synchronous_tokens(lora_world: World):
    """Graphs on and each step launched before the host reads the step before's tokens (they
    reach the next step's inputs on the device): PEFT's float32 greedy tokens, and in a batch of
    seeded sampling and token masks, the synchronous engine's tokens."""
    options = dict(device="cuda", dtype="float32", lora_backend="triton",
                   attention_backend="triton", max_num_seqs=8)
    pipelined = lora_world.llm(async_scheduling=True, **options)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    lora_world.check(pipelined.generate(lora_world.prompts, greedy, adapters=lora_world.requests),
                     "cuda float32 with graphs and async scheduling")
    params = [SamplingParams(max_tokens=MAX_TOKENS - i % 5, ignore_eos=True,
                             **(dict(temperature=0.9, seed=i) if i % 2 else
                                dict(temperature=0.0, logit_bias={5: 3.0})))
              for i in range(2 * len(lora_world.requests))]
    prompts, adapters = lora_world.prompts * 2, lora_world.requests * 2
    got = pipelined.generate(prompts, params, adapters=adapters)
    sync = lora_world.llm(**options)
    want = sync.generate(prompts, params, adapters=adapters)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert pipelined.engine.num_free_kv_blocks == pipelined.engine.block_manager.num_blocks


def test_an_async_step_never_waits_for_the_device(lora_world: World):
    """Under async scheduling a step (schedule, prepare with the step in flight's tokens, launch,
    read the step before's) calls nothing that waits for the device's queue, a step that
    prefills a request arriving beside decoding rows included: torch raises on any
    synchronizing op in sync-debug mode. A first round captures every graph the second needs."""
    llm = lora_world.llm(async_scheduling=True, device="cuda", dtype="float32",
                         lora_backend="triton", attention_backend="triton", max_num_seqs=8,
                         enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    late = lora_world.prompts[0][::-1]

    def run(checked: bool) -> None:
        for prompt, adapter in zip(lora_world.prompts[:6], lora_world.requests[:6]):
            engine.add_request(prompt, params, adapter=adapter)
        for _ in range(3):  # the prefill, then decode steps
            engine.step()
        assert engine.in_flight is not None
        if checked:
            torch.cuda.set_sync_debug_mode("error")
        try:
            engine.add_request(late, params, adapter=lora_world.requests[1])
            for _ in range(4):  # its prefill beside the decode rows, then decode steps
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        while engine.has_unfinished():
            engine.step()

    run(checked=False)
    run(checked=True)
