"""Sampler: each row follows its own request's SamplingParams, whatever shares the batch."""

from __future__ import annotations

import math

import pytest
import torch

from loragw.engine.request.params import SamplingParams
from loragw.engine.request.sequence import Sequence
from loragw.engine.request.structured import GuidedDecoding
from loragw.engine.runner.sampler import Sampler, apply_penalties

V = 64


def seq(prompt: list[int] | None = None, output: list[int] = (), **params) -> Sequence:
    s = Sequence(prompt_token_ids=list(prompt or [1, 2, 3]), params=SamplingParams(**params))
    s.token_ids.extend(output)
    return s


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log().unsqueeze(0)  # [1, V]


def support(probs: list[float], n: int = 400, **params) -> set[int]:
    """Tokens drawn from one row over n independent (unseeded) rows of a single batch."""
    logits = logits_from_probs(probs).expand(n, -1).contiguous()
    return set(Sampler(seed=0)(logits, [seq(**params) for _ in range(n)]).token_ids)


def test_greedy_batch_is_argmax_with_first_index_on_ties():
    logits = torch.randn(32, V)
    logits[0, 5] = logits[0, 9] = 100.0  # a tie: first index wins, as in transformers
    out = Sampler()(logits, [seq(temperature=0.0) for _ in range(32)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[0] == 5
    assert out.logprobs == [None] * 32


def test_top_k_1_equals_greedy_at_any_temperature():
    logits = torch.randn(16, V)
    out = Sampler()(logits, [seq(temperature=1.5, top_k=1) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_batch_greedy_rows_stay_argmax():
    logits = torch.randn(8, V)
    seqs = [seq(temperature=0.0) if i % 2 else seq(temperature=1.0) for i in range(8)]
    out = Sampler()(logits, seqs)
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in range(1, 8, 2)] == [argmax[i] for i in range(1, 8, 2)]


def test_caller_logits_are_not_modified():
    logits = torch.randn(4, V)
    before = logits.clone()
    seqs = [seq(output=[1, 2], temperature=0.7, top_k=5, top_p=0.8, min_p=0.1,
                repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5)
            for _ in range(4)]
    Sampler()(logits, seqs)
    assert torch.equal(logits, before)


PROBS = [0.5, 0.3, 0.1, 0.06, 0.04]


@pytest.mark.parametrize(("params", "expected"), [
    ({"top_k": 2}, {0, 1}),
    ({"top_k": 3}, {0, 1, 2}),
    ({"top_p": 0.7}, {0, 1}),
    ({"top_p": 0.85}, {0, 1, 2}),
    ({"min_p": 0.25}, {0, 1}),  # keeps p >= 0.125
    ({"min_p": 0.1}, {0, 1, 2, 3}),  # keeps p >= 0.05
    ({"top_k": 3, "top_p": 0.7}, {0, 1}),
    ({}, {0, 1, 2, 3, 4}),
])
def test_filters_restrict_the_support(params, expected):
    assert support(PROBS, n=2000, **params) == expected


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax_frequencies(temperature):
    n = 20000
    base = torch.tensor([[1.0, 0.0, -0.5, 0.5]])
    out = Sampler(seed=1)(base.expand(n, -1).contiguous(),
                          [seq(temperature=temperature) for _ in range(n)])
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / n
    expected = torch.softmax(base[0] / temperature, dim=-1)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_penalties_match_a_hand_computed_example():
    # prompt [0, 1], output [1, 3, 3]; repetition 2 over prompt+output, frequency 0.5 and
    # presence 0.25 over the output only.
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    s = seq(prompt=[0, 1], output=[1, 3, 3], repetition_penalty=2.0,
            frequency_penalty=0.5, presence_penalty=0.25)
    expected = torch.tensor([[
        2.0 / 2,               # seen in the prompt only: repetition only
        -1.0 * 2 - 0.5 - 0.25,  # once in the output
        0.5,                   # never seen
        3.0 / 2 - 2 * 0.5 - 0.25,  # twice in the output
        -2.0,                  # never seen
    ]])
    assert torch.allclose(apply_penalties(logits, [s]), expected)
    # Raw argmax is token 3; after penalties the greedy pick is token 0.
    assert Sampler()(logits, [seq(prompt=[0, 1], output=[1, 3, 3], temperature=0.0,
                                  repetition_penalty=2.0, frequency_penalty=0.5,
                                  presence_penalty=0.25)]).token_ids == [0]


def test_penalties_apply_only_to_rows_that_ask():
    logits = torch.tensor([[0.0, 3.0, 1.0]]).repeat(2, 1)
    seqs = [seq(prompt=[1], output=[1], temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0),
            seq(prompt=[1], output=[1], temperature=0.0)]
    assert Sampler()(logits, seqs).token_ids == [2, 1]


def run_stream(order: list[int], seeds: list[int | None], steps: int = 12) -> dict[int, list[int]]:
    """Sample `steps` tokens for rows keyed by index in `seeds`, batched in `order`."""
    make = torch.Generator().manual_seed(123)
    # Each key has its own logits per step, so a row's inputs do not depend on the batch.
    per_step = [torch.randn(len(seeds), V, generator=make) for _ in range(steps)]
    seqs = {k: seq(temperature=0.9, top_p=0.95, seed=seeds[k]) for k in order}
    streams: dict[int, list[int]] = {k: [] for k in order}
    sampler = Sampler(seed=sum(order))  # unseeded rows see a different stream per layout
    for step in range(steps):
        logits = per_step[step][order]
        out = sampler(logits, [seqs[k] for k in order])
        for k, t in zip(order, out.token_ids, strict=True):
            streams[k].append(t)
            seqs[k].token_ids.append(t)
    return streams


def test_seeded_rows_reproduce_across_batch_composition_and_order():
    seeds = [7, 8, None, None, 9]
    alone = {k: run_stream([k], seeds)[k] for k in (0, 1, 4)}
    together = run_stream([0, 1, 2, 3, 4], seeds)
    shuffled = run_stream([3, 4, 2, 1, 0], seeds)
    pair = run_stream([4, 0], seeds)
    for k in (0, 1, 4):
        assert together[k] == alone[k] == shuffled[k]
    assert pair[0] == alone[0] and pair[4] == alone[4]
    assert alone[0] != alone[1]  # different seeds, different streams
    assert len(set(alone[0])) > 1  # really sampling, not collapsed to greedy


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(3, V)
    seqs = [seq(output=[4, 4], temperature=0.5, logprobs=3, repetition_penalty=1.5,
                frequency_penalty=1.0),
            seq(temperature=0.0),
            seq(temperature=0.0, logprobs=0)]
    out = Sampler()(logits, seqs)
    raw = torch.log_softmax(logits, dim=-1)
    lp = out.logprobs[0]
    assert lp is not None and lp.token_id == out.token_ids[0]
    assert math.isclose(lp.logprob, raw[0, lp.token_id].item(), abs_tol=1e-6)
    top_lp, top_ids = raw[0].topk(3)
    assert [i for i, _ in lp.top] == top_ids.tolist()
    assert all(math.isclose(a, b, abs_tol=1e-6)
               for (_, a), b in zip(lp.top, top_lp.tolist(), strict=True))
    assert out.logprobs[1] is None
    assert out.logprobs[2] is not None and out.logprobs[2].top == []
    assert math.isclose(out.logprobs[2].logprob, raw[2].max().item(), abs_tol=1e-6)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"top_p": 0.0}, "top_p must be in \\(0, 1\\]"),
    ({"top_p": 1.5}, "top_p must be in \\(0, 1\\]"),
    ({"temperature": -0.1}, "temperature must be non-negative"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"logprobs": -1}, "logprobs"),  # the cap (--max-logprobs) is the engine's: test_engine.py
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_invalid_sampling_params_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


# ---- logit_bias, allowed_token_ids, min_tokens -------------------------------------------------
def test_logit_bias_bans_and_forces_tokens_of_its_row_only():
    logits = torch.randn(3, V)
    argmax = logits.argmax(dim=-1).tolist()
    seqs = [seq(temperature=0.0, logit_bias={argmax[0]: -100.0}),
            seq(temperature=0.0, logit_bias={7: 100.0}),
            seq(temperature=0.0)]
    out = Sampler()(logits, seqs).token_ids
    assert out[0] != argmax[0]
    assert out[0] == logits[0].topk(2).indices[1].item()  # the runner-up takes over
    assert out[1] == 7
    assert out[2] == argmax[2]  # the row without logit_bias is untouched
    # sampled rows too: +100 leaves every other token e^-100 times less likely
    assert support([0.2] * 5, n=500, logit_bias={3: 100.0}) == {3}
    assert 0 not in support([0.96, 0.01, 0.01, 0.01, 0.01], n=500, logit_bias={0: -100.0})


def test_logit_bias_comes_before_penalties():
    # token 0 is in the prompt; repetition 2 halves positive logits. Bias first:
    # (1 + 1) / 2 = 1.0 < 1.2, so token 1 wins; bias after would give 0.5 + 1 = 1.5 > 1.2.
    logits = torch.tensor([[1.0, 1.2]])
    s = seq(prompt=[0], temperature=0.0, repetition_penalty=2.0, logit_bias={0: 1.0})
    assert Sampler()(logits, [s]).token_ids == [1]


def test_allowed_token_ids_restrict_the_support():
    assert support(PROBS, n=2000, allowed_token_ids=[2, 4]) == {2, 4}
    logits = torch.randn(2, V)
    allowed = [3, 9, 40]
    out = Sampler()(logits, [seq(temperature=0.0, allowed_token_ids=allowed),
                             seq(temperature=0.0)]).token_ids
    assert out[0] == allowed[logits[0, allowed].argmax().item()]
    assert out[1] == logits[1].argmax().item()


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    eos, stop = 5, 6
    logits = torch.zeros(1, V)
    logits[0, eos], logits[0, stop], logits[0, 9] = 3.0, 2.0, 1.0
    sampler = Sampler(eos_token_ids=[eos])

    def pick(output: list[int], **params) -> int:
        return sampler(logits, [seq(output=output, temperature=0.0, min_tokens=3,
                                    stop_token_ids=[stop], **params)]).token_ids[0]

    assert pick([1]) == 9 and pick([1, 2]) == 9  # fewer than 3 outputs: neither may end it
    assert pick([1, 2, 3]) == eos  # 3 outputs: EOS may come now
    assert pick([1], ignore_eos=True) == eos  # an ignored EOS ends nothing: not masked
    assert pick([1], allowed_token_ids=[eos, stop, 9]) == 9


def test_rows_without_these_parameters_build_nothing(monkeypatch):
    import loragw.engine.runner.sampler as sampler_module

    def fail(*args, **kwargs):
        raise AssertionError("no row asked for logit_bias, allowed_token_ids or min_tokens")

    monkeypatch.setattr(sampler_module, "apply_token_edits", fail)
    seqs = [seq(output=[1, 2], temperature=0.7, top_k=5, repetition_penalty=1.3),
            seq(temperature=0.0, logprobs=2), seq(output=[1, 2, 3], min_tokens=3)]
    Sampler(eos_token_ids=[0])(torch.randn(3, V), seqs)  # min_tokens already met: no edit


def test_edits_leave_the_callers_logits_alone():
    logits = torch.randn(3, V)
    before = logits.clone()
    seqs = [seq(logit_bias={1: 5.0, 2: -100.0}, repetition_penalty=1.2),
            seq(allowed_token_ids=[4, 5]), seq(min_tokens=4, stop_token_ids=[3])]
    Sampler(eos_token_ids=[0])(logits, seqs)
    assert torch.equal(logits, before)


@pytest.mark.parametrize(("kwargs", "param", "message"), [
    ({"logit_bias": {3: 100.5}}, "logit_bias", "logit_bias\\[3\\] must be in \\[-100, 100\\]"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias", "logit_bias key -1 is not a token id"),
    ({"logit_bias": {"7": 1.0}}, "logit_bias", "logit_bias key '7' is not a token id"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "must not be empty"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids", "non-negative"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "must be in \\[0, max_tokens=4\\]"),
    ({"min_tokens": -1}, "min_tokens", "min_tokens"),
    ({"min_tokens": 2, "guided": GuidedDecoding("regex", "a+")}, "min_tokens",
     "min_tokens cannot be combined with structured output"),
    ({"allowed_token_ids": [1], "guided": GuidedDecoding("json_object")}, "allowed_token_ids",
     "allowed_token_ids cannot be combined with structured output"),
])
def test_new_sampling_params_name_the_bad_parameter(kwargs, param, message):
    with pytest.raises(ValueError, match=message) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_token_ids_are_checked_against_the_vocabulary():
    SamplingParams(logit_bias={63: 1.0}, allowed_token_ids=[0, 63]).check_token_ids(V)
    with pytest.raises(ValueError, match="logit_bias key 64 is not a token of this model"):
        SamplingParams(logit_bias={1: 1.0, 64: 1.0}).check_token_ids(V)
    with pytest.raises(ValueError, match="allowed_token_ids token id 99 is not a token"):
        SamplingParams(allowed_token_ids=[99]).check_token_ids(V)
