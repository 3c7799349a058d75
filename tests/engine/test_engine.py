"""Engine behaviour a user notices: blocks come back, aborts free at once, bad input is refused
without disturbing others, seeds reproduce, stop conditions end requests."""

import asyncio

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"), device="cpu", dtype="float32", max_num_seqs=8,
               block_size=4)


def all_blocks_free(llm) -> bool:
    return llm.engine.num_free_kv_blocks == llm.engine.block_manager.num_blocks


def test_text_prompts_and_token_prompts_agree(llm):
    text = "hello world"
    ids = llm.tokenizer.encode(text)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    a, b = llm.generate([text, ids], params)
    assert a.token_ids == b.token_ids
    assert a.text == llm.tokenizer.decode(a.token_ids, skip_special_tokens=True)
    assert all_blocks_free(llm)


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm):
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=12, temperature=1.3, top_k=20, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], seeded)[0].token_ids
    crowd = llm.generate([[9, 9], [5, 6, 7], [1, 2, 3, 4, 5]], [other, seeded, other])[1].token_ids
    reordered = llm.generate([[5, 6, 7], [3]], [seeded, other])[0].token_ids
    assert alone == crowd == reordered


def test_bad_input_is_refused_with_clear_messages(llm):
    limit = llm.config.max_model_len
    with pytest.raises(ValueError, match=f"maximum context length is {limit}"):
        llm.generate([[1] * limit], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**9]], SamplingParams(max_tokens=2))
    # A bad prompt in a list changes nothing: the good ones were not queued either.
    with pytest.raises(ValueError):
        llm.generate([[1, 2], [1] * limit], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished() and all_blocks_free(llm)
    out = llm.generate([[1, 2]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_stop_token_ids_and_max_tokens(llm):
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    full = llm.generate([[4, 5, 6]], greedy)[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 10
    stop_at = full.token_ids[3]
    first = full.token_ids.index(stop_at)
    stopped = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=10, temperature=0.0,
                                                       ignore_eos=True,
                                                       stop_token_ids=[stop_at]))[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
    assert stopped.token_ids == full.token_ids[:first + 1]


def test_stop_string_is_not_leaked(llm):
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    full = llm.generate(["the cat"], greedy)[0]
    assert len(full.text) > 4
    stop = full.text[2:4]
    out = llm.generate(["the cat"], SamplingParams(max_tokens=16, temperature=0.0,
                                                   ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and full.text.startswith(out.text)


def test_logprobs_have_alternatives(llm):
    out = llm.generate([[3, 4]], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3,
                                                ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token and len(lp.top) == 3
        assert lp.top[0][0] == token  # greedy picks the most likely token
        assert lp.logprob <= 0.0


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    ids = [engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=50, ignore_eos=True))
           for _ in range(3)]
    engine.step()
    engine.step()
    assert engine.num_free_kv_blocks < engine.block_manager.num_blocks
    for request_id in ids:
        out = engine.abort(request_id)
        assert out.finished and out.finish_reason == "abort"
    assert not engine.has_unfinished() and all_blocks_free(llm)


def test_async_engine_streams_and_aborts_on_disconnect(llm):
    async def main():
        engine = AsyncEngine(llm.engine)
        try:
            params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
            expected = llm.engine  # same engine, driven by the background thread now
            stream = await engine.submit([7, 8, 9], params)
            chunks = [out async for out in stream]
            assert chunks[-1].finished and sum(len(c.new_token_ids) for c in chunks) == 6
            # A consumer that walks away mid-stream aborts its sequence.
            long = await engine.submit([7, 8], SamplingParams(max_tokens=200, ignore_eos=True))
            async for _ in long:
                break
            await long.aclose()
            for _ in range(100):
                if not expected.has_unfinished():
                    break
                await asyncio.sleep(0.01)
            assert not expected.has_unfinished()
            with pytest.raises(ValueError):
                await engine.submit([1] * 10**5, params)
        finally:
            engine.shutdown()

    asyncio.run(main())
    assert all_blocks_free(llm)
