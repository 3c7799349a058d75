"""Each chat family served end to end: a tiny model trained here to answer in the family's own
syntax (family_models.py) is served by `loragw serve` with the parsers on `auto`, and read with
the `openai` client, whole and streamed, at temperature 0:

    a call       the thinking in `reasoning` (and `reasoning_content`), the call in `tool_calls`
                 with arguments that are valid JSON for the tool's schema, finish_reason
                 "tool_calls", reasoning tokens counted in usage
    a plain one  the thinking and the answer apart, finish_reason "stop"
    Qwen3        `enable_thinking: false`: the template closes an empty think block, and the
                 answer has no reasoning
    R1           the generation prompt opens <think>: the output starts inside the thinking

and a stream, its deltas joined, says exactly what the whole response says. /tokenize renders a
conversation with calls (arguments as JSON strings, as OpenAI sends them) and their results
(tool_call_id, name) to the same token ids as transformers' apply_chat_template.

One server per family, shared by every test of that family (pytest groups the tests by family).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import openai
import pytest
from chat_families import CALL_ARGUMENTS, FAMILIES, WEATHER_TOOL, conversation
from chat_replies import MAX_TOKENS, Reply, ask, assert_answers
from family_models import (
    ANSWER,
    PROMPTS,
    THOUGHT,
    FamilyModel,
    examples,
    greedy_answers,
)
from family_servers import FamilyServer, FamilyServers
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow



@pytest.fixture(scope="session")
def family_servers(request, family_models, tmp_path_factory):
    """The families' servers, in the order the session's tests take them."""
    order: list[str] = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("served") if callspec is not None else None
        if name is not None and name not in order:
            order.append(name)
    servers = FamilyServers(family_models, tmp_path_factory.mktemp("family-servers"), order)
    yield servers
    servers.close()


@dataclass
class Served:
    server: FamilyServer
    client: openai.OpenAI

    @property
    def name(self) -> str:
        return self.server.name

    @property
    def model(self) -> FamilyModel:
        return self.server.model

    def chat(self, key: str, stream: bool, **extra) -> Reply:
        """The answer to PROMPTS[key], whole or joined from a stream."""
        return ask(self.client, self.name, PROMPTS[key], stream, **extra)

    def tokenize(self, body: dict) -> httpx.Response:
        return httpx.post(self.server.url + "/tokenize", json={"model": self.name, **body},
                          timeout=60)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, family_servers):
    """The family's server (pytest runs each family's tests together, then stops it)."""
    server = family_servers.take(request.param)
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120) as client:
            yield Served(server, client)
    finally:
        family_servers.stop(request.param)


def only(*names: str):
    """Runs a test on these families' servers only (the same servers the others use)."""
    return pytest.mark.parametrize("served", names, indirect=True)


# --- served ----------------------------------------------------------------------------

def test_auto_picks_the_family_parsers(served):
    log = served.server.log_path.read_text()
    family = served.model.family
    assert (f"reasoning parser: {family.reasoning_parser or 'none'} (auto, from the chat "
            "template)") in log
    assert f"tool-call parser: {family.tool_parser or 'none'} (auto, from the chat template)" \
        in log


def test_a_call_reads_as_reasoning_and_tool_calls(served):
    reply = served.chat("call", stream=False)
    assert_answers(reply, served.model.answers["call"], served.name)


def test_a_plain_answer_reads_as_reasoning_and_content(served):
    reply = served.chat("plain", stream=False)
    assert_answers(reply, served.model.answers["plain"], served.name)


@pytest.mark.parametrize("key", ["call", "plain"])
def test_a_stream_says_what_the_whole_response_says(served, key):
    streamed, whole_reply = served.chat(key, stream=True), served.chat(key, stream=False)
    assert_answers(streamed, served.model.answers[key], served.name)
    assert streamed.without_ids() == whole_reply.without_ids()


@only("qwen3")
@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_without_thinking_has_no_reasoning(served, stream):
    reply = served.chat("quiet", stream=stream)
    assert_answers(reply, served.model.answers["quiet"], served.name)
    assert reply.content == ANSWER


@only("qwen3")
def test_responses_reasoning_effort_none_turns_the_thinking_off(served):
    """/v1/responses: the thinking comes back as a reasoning item; `reasoning.effort` "none"
    renders the template without it (enable_thinking false), as chat's "quiet" prompt does."""
    question = PROMPTS["plain"].messages[0]["content"]
    thinking = served.client.responses.create(model=served.name, input=question, temperature=0,
                                              max_output_tokens=MAX_TOKENS)
    kinds = [item.type for item in thinking.output]
    assert kinds == ["reasoning", "message"], kinds
    assert thinking.output[0].content[0].text.strip() == THOUGHT
    assert thinking.output_text.strip() == ANSWER
    quiet = served.client.responses.create(model=served.name, input=question, temperature=0,
                                           max_output_tokens=MAX_TOKENS,
                                           reasoning={"effort": "none"})
    assert [item.type for item in quiet.output] == ["message"]
    assert quiet.output_text == ANSWER and quiet.reasoning.effort == "none"


@only("deepseek_r1_distill_qwen")
@pytest.mark.parametrize("stream", [False, True])
def test_r1_answers_from_inside_the_thinking_its_prompt_opened(served, stream):
    tokens = served.tokenize({"messages": list(PROMPTS["plain"].messages)})
    assert tokens.status_code == 200, tokens.text
    tokenizer = AutoTokenizer.from_pretrained(served.model.directory)
    assert tokenizer.decode(tokens.json()["tokens"]).endswith("<｜Assistant｜><think>\n")
    assert not served.model.answers["plain"].text.startswith("<think>")
    reply = served.chat("plain", stream=stream)
    assert reply.reasoning.strip() == THOUGHT and reply.content.strip() == ANSWER, reply
    assert "</think>" not in reply.content + reply.reasoning


# --- the rendered prompt -------------------------------------------------------------------

def openai_messages(name: str, reasoning: str | None = None) -> list[dict]:
    """conversation() as an OpenAI client sends it: the call's arguments as a JSON string."""
    messages = conversation(FAMILIES[name], reasoning=reasoning)
    for message in messages:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return messages


def transformers_messages(name: str, reasoning: str | None = None) -> list[dict]:
    """The same conversation as transformers' users pass it to apply_chat_template: arguments
    as objects (templates apply `| tojson`), except for R1's template, which pastes them in as
    text."""
    arguments = json.dumps(CALL_ARGUMENTS) if name == "deepseek_r1_distill_qwen" else None
    return conversation(FAMILIES[name], arguments, reasoning=reasoning)


def transformers_ids(served: Served, messages: list[dict], **kwargs) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(served.model.directory)
    rendered = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                             add_generation_prompt=True, **kwargs)
    return list(rendered["input_ids"])


def test_a_conversation_with_calls_and_results_renders_as_transformers_renders_it(served):
    response = served.tokenize({"messages": openai_messages(served.name),
                                "tools": [WEATHER_TOOL]})
    assert response.status_code == 200, response.text
    expected = transformers_ids(served, transformers_messages(served.name), tools=[WEATHER_TOOL])
    assert response.json()["tokens"] == expected


@only("qwen3")
def test_reasoning_in_a_tool_loop_renders_as_transformers_renders_it(served):
    """Qwen3 shows the thinking of the turns after the last user query: the server passes an
    assistant's `reasoning_content` to the template."""
    thought = "\nI should look it up.\n"
    messages = openai_messages(served.name, reasoning=thought)[:4]
    response = served.tokenize({"messages": messages, "tools": [WEATHER_TOOL]})
    assert response.status_code == 200, response.text
    reference = transformers_messages(served.name, reasoning=thought)[:4]
    assert response.json()["tokens"] == transformers_ids(served, reference, tools=[WEATHER_TOOL])


@only("qwen3")
def test_tokenize_renders_with_chat_template_kwargs(served):
    """vLLM's /tokenize takes the chat request's chat_template_kwargs (Qwen3's
    enable_thinking), as /v1/chat/completions renders with them."""
    messages = list(PROMPTS["quiet"].messages)
    response = served.tokenize({"messages": messages,
                                "chat_template_kwargs": {"enable_thinking": False}})
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == transformers_ids(served, messages, enable_thinking=False)


# --- the trained models themselves (last: the servers' fixtures trained them by now) ------

@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_trained_model_writes_its_answers_greedily(family_models, name):
    """transformers' greedy decoding writes each trained answer, token for token: what the
    server is then expected to write."""
    model = family_models[name]
    tokenizer = AutoTokenizer.from_pretrained(model.directory)
    trained = examples(tokenizer, model.answers)
    written = greedy_answers(model.directory, [e.ids[:e.prompt_len] for e in trained])
    for example, ids, (key, answer) in zip(trained, written, model.answers.items(), strict=True):
        wanted = example.ids[example.prompt_len:]
        assert ids == wanted, (name, key, tokenizer.decode(ids, skip_special_tokens=False))
        assert tokenizer.decode(wanted, skip_special_tokens=False) == answer.text
