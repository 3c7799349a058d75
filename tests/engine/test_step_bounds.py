"""What bounds a running stream's worst step, watched on the engine itself: while sequences
decode, a step prefills at most max_prefill_tokens_decoding prompt tokens (the full budget
when nothing decodes); an adapter re-read from disk is read off the step loop, so streams keep
decoding while it loads; and the CPU decode path's chunked attention (rows by context length,
cache-sized gathers) gives the tokens the single batched gather gives."""

import shutil
import threading
import time

import pytest
import torch
from small_world import make_llm, prompts

from loragw.engine import LLM, SamplingParams
from loragw.engine.config import Config
from loragw.engine.llm_engine import LLMEngine
from loragw.engine.lora import reads

pytestmark = pytest.mark.timeout(120)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def long_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def watch_batches(engine: LLMEngine) -> list:
    """(decode rows, prefill tokens) of every step from now on."""
    seen = []
    schedule = engine.scheduler.schedule

    def watched():
        batch = schedule()
        seen.append((batch.num_decode, batch.num_tokens - batch.num_decode))
        return batch

    engine.scheduler.schedule = watched
    return seen


def test_prefill_is_capped_while_sequences_decode(checkpoint):
    base, _ = checkpoint
    engine = LLMEngine(Config(base, device="cpu", dtype="float32", max_num_batched_tokens=64,
                              max_prefill_tokens_decoding=8))
    short = engine.add_request(prompts(1)[0], greedy(30))
    engine.step()  # its prefill: nothing decodes yet, so the whole budget
    seen = watch_batches(engine)
    late = [engine.add_request(long_prompt(40, seed), greedy(4)) for seed in range(2)]
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    decoding = [prefill for decode, prefill in seen if decode]
    assert decoding and max(decoding) <= 8, seen
    assert sum(decoding) >= 2 * 40 - 8, "the long prompts were not prefilled beside the decodes"
    # with nothing decoding, a long prompt takes the whole budget at once
    seen.clear()
    alone = engine.add_request(long_prompt(60, 7), greedy(2))
    engine.step()
    assert seen[0] == (0, 60)
    while engine.has_unfinished():
        engine.step()
    # chunking changed no token
    llm = LLM(base, device="cpu", dtype="float32")
    solo = llm.generate([prompts(1)[0], long_prompt(40, 0), long_prompt(40, 1)],
                        [greedy(30), greedy(4), greedy(4)])
    got = [outputs[short][-29:], outputs[late[0]], outputs[late[1]]]
    assert [s.token_ids[-29:] if i == 0 else s.token_ids for i, s in enumerate(solo)] == got
    assert alone not in outputs


def test_max_prefill_tokens_decoding_is_validated(checkpoint):
    with pytest.raises(ValueError, match="max_prefill_tokens_decoding must be at least 1"):
        Config(checkpoint[0], max_prefill_tokens_decoding=0)


def test_an_adapter_read_from_disk_never_stalls_running_streams(checkpoint, monkeypatch):
    """With one host copy kept, ad1's copy is evicted while ad0 serves; ad1's next request
    re-reads it from disk (held up here for 0.4 s) while ad0's stream keeps decoding."""
    llm = make_llm(checkpoint, max_loras=2, max_cpu_loras=1)
    engine = llm.engine
    ps = prompts(2, seed=3)
    solo = {a: llm.generate([ps[i]], greedy(12), [a])[0].token_ids
            for i, a in enumerate(("ad0", "ad1"))}
    engine.lora.evict("ad1")  # off the device and out of host memory: on disk only
    assert engine.lora.residency("ad1") == "disk"
    release = threading.Event()
    read = reads.read_adapter

    def slow_read(path, spec, weights_sha256):
        release.wait(0.4)
        return read(path, spec, weights_sha256)

    monkeypatch.setattr(reads, "read_adapter", slow_read)
    running = engine.add_request(ps[0], greedy(12), adapter="ad0")
    engine.step()
    waiting = engine.add_request(ps[1], greedy(12), adapter="ad1")
    tokens: dict[str, list[int]] = {running: [], waiting: []}
    started, steps_while_reading = time.monotonic(), []
    while engine.has_unfinished():
        t0 = time.monotonic()
        outs = engine.step()
        if engine.lora.reads.pending:
            steps_while_reading.append(time.monotonic() - t0)
        for out in outs:
            tokens[out.request_id].extend(out.new_token_ids)
    assert time.monotonic() - started >= 0.3
    assert len(steps_while_reading) >= 2 and max(steps_while_reading) < 0.3
    assert tokens[waiting] == solo["ad1"]
    assert engine.lora.stats.host_loads >= 1


def test_chunked_decode_attention_gives_the_batched_tokens(checkpoint, monkeypatch):
    """One row per chunk (the smallest budget) against the single padded gather, on prompts of
    different lengths, so chunks differ in width and rows leave their batch order."""
    from loragw.engine.runner import inputs as step_inputs

    base, _ = checkpoint
    ps = [long_prompt(n, seed) for seed, n in enumerate((3, 37, 12, 70, 21))]
    llm = LLM(base, device="cpu", dtype="float32", block_size=4, attention_backend="torch")
    assert llm.engine.runner.kv_token_bytes  # the CPU runner plans chunks
    monkeypatch.setattr(step_inputs, "DECODE_CHUNK_BYTES", 1)
    chunked = [o.token_ids for o in llm.generate(ps, greedy(10))]
    llm.engine.runner.kv_token_bytes = None  # the single batched gather
    batched = [o.token_ids for o in llm.generate(ps, greedy(10))]
    assert chunked == batched


def test_an_adapter_gone_bad_on_disk_fails_only_its_requests(checkpoint, tmp_path):
    """ad1's disk copy is overwritten after its host copy was evicted: the request that needs it
    fails with why (take_failures; LLM.generate raises it), the stream on ad0 goes on."""
    llm = make_llm(checkpoint, max_loras=2, max_cpu_loras=1)
    engine = llm.engine
    copy = tmp_path / "bad"
    shutil.copytree(checkpoint[1]["ad1"], copy)
    engine.add_adapter("bad", str(copy))
    engine.lora.evict("bad")
    (copy / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    ps = prompts(2, seed=4)
    solo = llm.generate([ps[0]], greedy(8), ["ad0"])[0].token_ids
    good = engine.add_request(ps[0], greedy(8), adapter="ad0")
    bad = engine.add_request(ps[1], greedy(8), adapter="bad")
    tokens, failures = [], []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() if out.request_id == good
                   for t in out.new_token_ids]
        failures += engine.take_failures()
    assert tokens == solo
    assert [ids for ids, _ in failures] == [[bad]]
    assert "could not be re-read" in failures[0][1] and engine.sequence(bad) is None
    with pytest.raises(RuntimeError, match="could not be re-read"):
        llm.generate([ps[1]], greedy(4), ["bad"])
    assert not engine.has_unfinished()
