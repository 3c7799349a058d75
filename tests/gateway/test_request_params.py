"""Request bodies -> SamplingParams, without a server: OpenAI's defaults, seeds per choice,
and the 400s that name the parameter at fault (those that need the model, the context window
among them, are the engine's: tests/engine/test_engine.py)."""

from __future__ import annotations

import pytest

from loragw.gateway.common.errors import APIError
from loragw.gateway.openai.params import (
    chat_logprobs,
    check_completion_options,
    choice_params,
    sampling_params,
)
from loragw.gateway.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

BASE = "demo-base"
HI = [ChatMessage(role="user", content="hi")]


def test_sampling_params_follow_openai_defaults_and_seed_offsets():
    chat = ChatCompletionRequest(model=BASE, messages=HI, seed=7, stop="END", max_tokens=9,
                                 max_completion_tokens=4)
    p = choice_params(sampling_params(chat, logprobs=None), num_prompts=1, n=3)[0][2]
    assert (p.max_tokens, p.seed, p.stop, p.temperature, p.top_p) == (4, 9, ["END"], 1.0, 1.0)
    bare = ChatCompletionRequest(model=BASE, messages=HI)
    # the rest of the context: the engine resolves None per prompt (test_engine.py)
    assert sampling_params(bare, None).max_tokens is None


def test_each_prompt_gets_n_choices_with_their_own_seeds():
    data = CompletionRequest(model=BASE, prompt=["a", "b"], n=2, seed=100, max_tokens=4)
    params, prompt_of = choice_params(sampling_params(data, None), num_prompts=2, n=data.n)
    assert prompt_of == [0, 0, 1, 1]
    assert [p.seed for p in params] == [100, 101, 100, 101]


def test_a_parameter_out_of_range_is_a_400_naming_it():
    data = CompletionRequest(model=BASE, prompt="x", max_tokens=8, min_tokens=9)
    with pytest.raises(APIError) as err:
        sampling_params(data, None)
    assert (err.value.status, err.value.param) == (400, "min_tokens")


@pytest.mark.parametrize("logprobs, top, expected", [(False, None, None), (True, None, 0),
                                                      (True, 3, 3)])
def test_chat_logprobs_become_a_count_of_alternatives(logprobs, top, expected):
    data = ChatCompletionRequest(model=BASE, messages=HI, logprobs=logprobs, top_logprobs=top)
    assert chat_logprobs(data) == expected


def test_top_logprobs_without_logprobs_is_refused():
    data = ChatCompletionRequest(model=BASE, messages=HI, top_logprobs=2)
    with pytest.raises(APIError) as err:
        chat_logprobs(data)
    assert (err.value.status, err.value.param) == (400, "top_logprobs")


@pytest.mark.parametrize("options, param", [({"suffix": "end"}, "suffix"),
                                            ({"best_of": 3}, "best_of"),
                                            ({"max_tokens": 0}, "max_tokens")])
def test_unsupported_completion_options_are_refused(options, param):
    with pytest.raises(APIError) as err:
        check_completion_options(CompletionRequest(model=BASE, prompt="x", **options))
    assert (err.value.status, err.value.param) == (400, param)


def test_best_of_equal_to_n_is_accepted():
    check_completion_options(CompletionRequest(model=BASE, prompt="x", n=2, best_of=2))
