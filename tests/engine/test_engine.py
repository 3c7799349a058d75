"""Engine behaviour a user notices: blocks come back, aborts free at once, bad input is refused
without disturbing others, seeds reproduce, stop conditions end requests."""

import asyncio

import pytest

from loragw.engine import LLM, SamplingParams
from loragw.engine.core.client import EngineClient
from loragw.engine.request.params import InvalidParam


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


def test_the_context_window_is_checked_once_naming_the_parameter(llm):
    """One message for the server and the offline API: InvalidParam names max_tokens (or the
    prompt, when max_tokens is left to the rest of the window) with OpenAI's error code."""
    limit = llm.config.max_model_len
    with pytest.raises(InvalidParam) as err:
        llm.engine.check_request([1] * (limit - 4), SamplingParams(max_tokens=8))
    assert (err.value.param, err.value.code) == ("max_tokens", "context_length_exceeded")
    assert f"{limit} tokens" in str(err.value) and f"{limit - 4} prompt tokens plus 8" in str(err.value)
    with pytest.raises(InvalidParam) as err:
        llm.engine.check_request([1] * limit, SamplingParams(max_tokens=None))
    assert err.value.param == "prompt"


def test_max_tokens_none_is_the_rest_of_the_context_window(llm):
    limit = llm.config.max_model_len
    rid = llm.engine.add_request([1] * 10, SamplingParams(max_tokens=None))
    assert llm.engine.sequence(rid).params.max_tokens == limit - 10
    llm.engine.abort(rid)
    assert all_blocks_free(llm)


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
        engine = EngineClient.on_thread(llm.engine)
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


# ---- logit_bias, min_tokens, allowed_token_ids, stop strings and special tokens ----------------
PROMPT = [4, 5, 6]


def greedy(max_tokens: int = 10, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def eos_id(llm) -> int:
    return min(llm.engine.eos_token_ids)


def test_logit_bias_bans_the_greedy_token_and_forces_another(llm):
    full = llm.generate([PROMPT], greedy(ignore_eos=True))[0].token_ids
    banned = llm.generate([PROMPT], greedy(ignore_eos=True, logit_bias={full[0]: -100}))[0]
    assert full[0] not in banned.token_ids[:1] and banned.token_ids != full
    forced = llm.generate([PROMPT], greedy(ignore_eos=True, logit_bias={77: 100}))[0]
    assert forced.token_ids == [77] * 10
    with pytest.raises(ValueError, match="logit_bias key 100000 is not a token of this model"):
        llm.generate([PROMPT], greedy(logit_bias={100000: 1.0}))
    assert all_blocks_free(llm)


def test_min_tokens_holds_off_eos(llm):
    eos = eos_id(llm)
    full = llm.generate([PROMPT], greedy(ignore_eos=True))[0]
    early = llm.generate([PROMPT], greedy(logit_bias={eos: 100}))[0]  # EOS at once
    assert early.token_ids == [eos] and early.finish_reason == "stop" and early.text == ""
    held = llm.generate([PROMPT], greedy(logit_bias={eos: 100}, min_tokens=5))[0]
    assert held.token_ids == full.token_ids[:5] + [eos]  # masked until 5 outputs, then wins
    assert held.finish_reason == "stop" and held.stop_reason is None
    assert held.text == llm.tokenizer.decode(full.token_ids[:5])
    stop = full.token_ids[0]
    by_id = llm.generate([PROMPT], greedy(ignore_eos=True, min_tokens=4, stop_token_ids=[stop],
                                          logit_bias={stop: 100}))[0]
    assert len(by_id.token_ids) == 5 and by_id.token_ids[-1] == stop
    assert by_id.stop_reason == stop and stop not in by_id.token_ids[:4]


def test_min_tokens_holds_off_stop_strings(llm):
    full = llm.generate(["the cat"], greedy(16, ignore_eos=True))[0]
    stop = full.text[2:4]
    out = llm.generate(["the cat"], greedy(16, ignore_eos=True, stop=[stop], min_tokens=16))[0]
    assert out.text == full.text and out.finish_reason == "length"


def test_include_stop_str_in_output_keeps_the_stop_string_and_token(llm):
    full = llm.generate(["the cat"], greedy(16, ignore_eos=True))[0]
    stop = full.text[2:4]
    out = llm.generate(["the cat"], greedy(16, ignore_eos=True, stop=[stop],
                                           include_stop_str_in_output=True))[0]
    assert out.stop_reason == stop and out.text == full.text[:full.text.index(stop) + 2]
    # A stop token's own text is left out, as vLLM does, unless asked for.
    token = full.token_ids[3]
    cut = full.token_ids.index(token) + 1
    kept = llm.generate(["the cat"], greedy(16, ignore_eos=True, stop_token_ids=[token],
                                            include_stop_str_in_output=True))[0]
    dropped = llm.generate(["the cat"], greedy(16, ignore_eos=True, stop_token_ids=[token]))[0]
    assert kept.token_ids == dropped.token_ids == full.token_ids[:cut]
    assert kept.text == llm.tokenizer.decode(full.token_ids[:cut])
    assert dropped.text == llm.tokenizer.decode(full.token_ids[:cut - 1])


def test_skip_special_tokens_false_keeps_them_in_the_text(llm):
    bos = llm.tokenizer.bos_token_id
    shown = llm.generate([PROMPT], greedy(3, ignore_eos=True, logit_bias={bos: 100},
                                          skip_special_tokens=False))[0]
    hidden = llm.generate([PROMPT], greedy(3, ignore_eos=True, logit_bias={bos: 100}))[0]
    assert shown.token_ids == hidden.token_ids == [bos] * 3
    assert shown.text == llm.tokenizer.bos_token * 3 and hidden.text == ""


def test_allowed_token_ids_are_the_only_ones_sampled(llm):
    allowed = [10, 11, 12, 200]
    outs = llm.generate([PROMPT] * 4, SamplingParams(max_tokens=12, temperature=1.5, seed=3,
                                                     ignore_eos=True, allowed_token_ids=allowed))
    assert all(set(o.token_ids) <= set(allowed) for o in outs)
    assert len({t for o in outs for t in o.token_ids}) > 1  # really sampling
    with pytest.raises(ValueError, match="min_tokens can never be met"):
        llm.generate([PROMPT], greedy(min_tokens=2, allowed_token_ids=sorted(
            llm.engine.eos_token_ids)))


def test_mixed_batch_leaves_unconstrained_rows_as_they_run_alone(llm):
    plain = greedy(12, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    constrained = [greedy(12, logit_bias={77: 100, 5: -100}),
                   greedy(12, allowed_token_ids=[10, 11, 12]),
                   greedy(12, logit_bias={eos_id(llm): 100}, min_tokens=6),
                   SamplingParams(max_tokens=12, temperature=1.0, seed=5, min_tokens=3,
                                  allowed_token_ids=[20, 21, eos_id(llm)])]
    prompts = [[1, 2, 3], [9, 8], PROMPT, [7, 7, 7, 7], [30, 31], [5, 6]]
    params = [plain, seeded, *constrained]
    mixed = llm.generate(prompts, params)
    for i in (0, 1):
        assert mixed[i].token_ids == llm.generate([prompts[i]], params[i])[0].token_ids
    assert mixed[2].token_ids == [77] * 12
    assert set(mixed[3].token_ids) <= {10, 11, 12}
    assert len(mixed[4].token_ids) == 7 and mixed[4].finish_reason == "stop"
    assert len(mixed[5].token_ids) >= 3 and set(mixed[5].token_ids) <= {20, 21, eos_id(llm)}
    assert all_blocks_free(llm)
