"""Request bodies -> SamplingParams, without a server: OpenAI's defaults, seeds per choice,
and the 400s that name the parameter at fault."""

from __future__ import annotations

import pytest

from gateway.errors import APIError
from gateway.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from gateway.request_params import (
    chat_logprobs,
    check_completion_options,
    choice_params,
    sampling_params,
)

BASE = "demo-base"
HI = [ChatMessage(role="user", content="hi")]


def test_sampling_params_follow_openai_defaults_and_seed_offsets():
    chat = ChatCompletionRequest(model=BASE, messages=HI, seed=7, stop="END", max_tokens=9,
                                 max_completion_tokens=4)
    p = sampling_params(chat, prompt_len=10, limit=512, logprobs=None, offset=2)
    assert (p.max_tokens, p.seed, p.stop, p.temperature, p.top_p) == (4, 9, ["END"], 1.0, 1.0)
    bare = ChatCompletionRequest(model=BASE, messages=HI)
    assert sampling_params(bare, 10, 512, None, 0).max_tokens == 502  # the rest of the context


def test_each_prompt_gets_n_choices_with_their_own_seeds():
    data = CompletionRequest(model=BASE, prompt=["a", "b"], n=2, seed=100, max_tokens=4)
    params, prompt_of = choice_params(data, [[1, 2], [3]], limit=64, logprobs=None)
    assert prompt_of == [0, 0, 1, 1]
    assert [p.seed for p in params] == [100, 101, 100, 101]


def test_a_prompt_past_the_context_window_is_a_400_naming_it():
    data = CompletionRequest(model=BASE, prompt="x", max_tokens=8)
    with pytest.raises(APIError) as err:
        choice_params(data, [[1] * 60], limit=64, logprobs=None)
    assert (err.value.status, err.value.param, err.value.code) == (
        400, "max_tokens", "context_length_exceeded")


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
                                            ({"echo": True, "logprobs": 1}, "echo")])
def test_unsupported_completion_options_are_refused(options, param):
    with pytest.raises(APIError) as err:
        check_completion_options(CompletionRequest(model=BASE, prompt="x", **options))
    assert (err.value.status, err.value.param) == (400, param)


def test_best_of_equal_to_n_is_accepted():
    check_completion_options(CompletionRequest(model=BASE, prompt="x", n=2, best_of=2))
