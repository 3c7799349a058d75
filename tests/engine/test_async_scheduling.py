"""Async scheduling (engine/sched/pipeline.py): a step is launched before the host reads the step
before's tokens, and nothing a user sees changes: the same tokens, text, finish and stop
reasons as the synchronous engine (and PEFT's greedy tokens), through stops, aborts,
preemption, prefix caching, and batches that mix requests the pipeline cannot hold."""

from __future__ import annotations

import pytest
from peft_reference import MAX_TOKENS, World

from loragw.engine import LLM, SamplingParams
from loragw.engine.request.sequence import PENDING


def engines(checkpoint: str, **options) -> tuple[LLM, LLM]:
    """(synchronous, async-scheduled) engines on one checkpoint with the same options."""
    base = dict(device="cpu", dtype="float32", max_num_seqs=6, block_size=4) | options
    return LLM(checkpoint, **base), LLM(checkpoint, async_scheduling=True, **base)


def workload() -> tuple[list, list[SamplingParams]]:
    """14 requests (more than the engines run at once): greedy and seeded, ending by length,
    EOS, stop token, stop string; some ask for logprobs or penalties, which the pipeline
    cannot hold (their steps are read at once)."""
    prompts, params = [], []
    for i in range(14):
        prompts.append([3 + i, 7, 11 + 2 * i, 5][: 1 + i % 4] * (1 + i % 3))
        kw = dict(max_tokens=3 + (i * 5) % 17, temperature=0.0, ignore_eos=i % 4 != 1)
        if i % 5 == 2:
            kw |= dict(temperature=0.8, top_p=0.9, seed=100 + i)
        if i % 6 == 3:
            kw |= dict(logprobs=2)
        if i % 7 == 4:
            kw |= dict(repetition_penalty=1.3, min_tokens=2)
        params.append(SamplingParams(**kw))
    return prompts, params


def same(a, b) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (
            y.token_ids, y.text, y.finish_reason, y.stop_reason), f"request {i}"
        assert [lp.token_id for lp in x.logprobs] == [lp.token_id for lp in y.logprobs]


def all_free(llm: LLM) -> bool:
    return llm.engine.num_free_kv_blocks == llm.engine.block_manager.num_blocks


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    return engines(tiny_checkpoint("llama"))


def test_the_same_outputs_as_the_synchronous_engine(pair):
    sync, pipelined = pair
    prompts, params = workload()
    expected = sync.generate(prompts, params)
    got = pipelined.generate(prompts, params)
    same(got, expected)
    assert not pipelined.engine.has_unfinished() and all_free(pipelined)
    assert pipelined.engine.in_flight is None or not pipelined.engine.in_flight.take()[0]


def test_stop_tokens_and_strings_end_where_they_do_without_it(pair):
    sync, pipelined = pair
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    full = sync.generate(["the cat"], greedy)[0]
    stop_token, stop = full.token_ids[5], full.text[3:5]
    for extra in (dict(stop_token_ids=[stop_token]), dict(stop=[stop]),
                  dict(stop=[stop], include_stop_str_in_output=True)):
        p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **extra)
        # beside a long request, so the pipeline keeps running after the stop
        long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        same(pipelined.generate(["the cat", "a dog"], [p, long]),
             sync.generate(["the cat", "a dog"], [p, long]))


def test_the_pipeline_holds_plain_steps_and_reads_the_rest_at_once(pair):
    _, pipelined = pair
    engine = pipelined.engine
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request([1, 2, 3], plain, request_id="plain")
    assert engine.step() == []  # its prefill sampled a token the host has not read
    seq = engine.sequence("plain")
    assert seq.pending and seq.token_ids[-1] == PENDING and engine.in_flight is not None
    outputs = engine.step()  # reads the first token, launches the second
    assert [o.num_output_tokens for o in outputs] == [1] and seq.pending
    engine.add_request([4, 5], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                              logprobs=1), request_id="logprobs")
    outputs = engine.step()  # a row with logprobs: this step is read before it returns
    assert {o.request_id: o.num_output_tokens for o in outputs} == {"plain": 3, "logprobs": 1}
    assert not seq.pending and engine.in_flight is None
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    # plain has 3 tokens to go, one step each; the last is read by one more step, which
    # schedules no row for it (its last position was known)
    assert steps == 4 and all_free(pipelined)


def test_abort_of_a_request_in_flight_drops_its_token(pair):
    sync, pipelined = pair
    engine = pipelined.engine
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request([9, 8, 7], params, request_id="gone")
    engine.add_request([6, 5, 4], params, request_id="kept")
    received = {"gone": [], "kept": []}
    for _ in range(4):
        for out in engine.step():
            received[out.request_id] += out.new_token_ids
    assert engine.sequence("gone").pending
    out = engine.abort("gone")
    assert out.finish_reason == "abort" and out.num_output_tokens == len(received["gone"])
    assert PENDING not in out.new_token_ids
    while engine.has_unfinished():
        for out in engine.step():
            received[out.request_id] += out.new_token_ids
    assert received["kept"] == sync.generate([[6, 5, 4]], params)[0].token_ids
    assert all_free(pipelined)


def test_a_failed_step_with_a_step_in_flight_leaves_the_engine_serving(pair, monkeypatch):
    """A step that raises while another is in flight (what the engine loop then does: abort
    every request it held) leaves no placeholder, block or stale token behind: the next
    requests get the synchronous engine's tokens."""
    sync, pipelined = pair
    engine = pipelined.engine
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request([4 + i, 9, 2], params, request_id=f"doomed-{i}")
    for _ in range(3):
        engine.step()
    assert engine.in_flight is not None
    run = engine.runner.run

    def fail(*args, **kwargs):
        raise RuntimeError("the device went away")

    monkeypatch.setattr(engine.runner, "run", fail)
    with pytest.raises(RuntimeError, match="went away"):
        engine.step()
    monkeypatch.setattr(engine.runner, "run", run)
    for request_id in list(engine.requests):  # as engine/core/loop.py does after a failed step
        engine.abort(request_id)
    engine.drain_aborted()
    assert not engine.has_unfinished() and all_free(pipelined)
    prompts = [[7, 3, 3, 1], [2, 8], [5, 5, 6]]
    same(pipelined.generate(prompts, params), sync.generate(prompts, params))
    assert all_free(pipelined)


def test_preemption_and_the_prefix_cache(tiny_checkpoint):
    """Too few KV blocks for every row (sequences are preempted and recomputed, some while a
    token is in flight), then prompts that extend earlier outputs: the same tokens, and the
    same cached prefix (a block completed by a token in flight joins the cache once read)."""
    sync, pipelined = engines(tiny_checkpoint("llama"), num_kv_blocks=12, max_model_len=40,
                              enable_prefix_caching=True)
    prompts = [[2 + i, 3, 4 + i] for i in range(6)]
    params = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    first = sync.generate(prompts, params)
    same(pipelined.generate(prompts, params), first)
    assert pipelined.engine.scheduler.num_preemptions > 0
    # a prompt that extends an earlier request's output finds its full blocks cached
    alone = sync.generate(prompts[:1], params)
    same(pipelined.generate(prompts[:1], params), alone)
    longer = [prompts[0] + alone[0].token_ids]
    more = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    a, b = sync.generate(longer, more), pipelined.generate(longer, more)
    same(b, a)
    assert b[0].num_cached_tokens == a[0].num_cached_tokens == 16  # 20 tokens: 4 full blocks
    assert all_free(pipelined)


def test_peft_greedy_tokens_with_many_adapters_in_one_batch(lora_world: World):
    llm = lora_world.llm(async_scheduling=True)
    outputs = llm.generate(lora_world.prompts, SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), adapters=lora_world.requests)
    lora_world.check(outputs, "async scheduling")


def test_refused_with_speculation_or_tensor_parallelism(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="async_scheduling cannot be combined with "
                                         "speculative_config"):
        LLM(path, device="cpu", async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        LLM(path, device="cpu", async_scheduling=True, tensor_parallel_size=2)
