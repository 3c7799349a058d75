"""The fixtures themselves: each family's template renders a conversation with tools, a call, its
result and an answer the way the family's real template does (the pieces, in their places and
order), refuses what the real one refuses with the real one's message, opens or closes thinking
in the generation prompt as the real one does, and each tokenizer marks its tokens special or
not as the family does."""

from __future__ import annotations

import json

import pytest
from chat_families import (
    CALL_ARGUMENTS,
    FAMILIES,
    RESULT,
    WEATHER_TOOL,
    conversation,
    render,
)
from jinja2.exceptions import TemplateError

CALL_JSON = json.dumps(CALL_ARGUMENTS)
DATE = {"date_string": "26 Jul 2024"}

# What each family renders for conversation(family) with tools and a generation prompt: these
# pieces, each after the one before.
EXPECTED = {
    "llama3_1": [
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "You are a weather bot.<|eot_id|>",
        "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please "
        "respond with a JSON for a function call",
        '{\n    "type": "function",\n    "function": {\n        "name": "get_weather"',
        "Weather in Paris?<|eot_id|>",
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": '
        + CALL_JSON + "}<|eot_id|>",
        "<|start_header_id|>ipython<|end_header_id|>\n\n" + json.dumps(RESULT) + "<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\nSunny, 22 degrees.<|eot_id|>",
        "And tomorrow?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"],
    "llama3_2": [
        "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n",
        "To call functions, please respond with a python list of the calls.",
        '"name": "get_weather"',
        "You are a weather bot.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "Weather in Paris?<|eot_id|>",
        '<|start_header_id|>assistant<|end_header_id|>\n\n[get_weather(city="Paris", days=3)]'
        "<|eot_id|>",
        "<|start_header_id|>ipython<|end_header_id|>\n\n" + json.dumps({"output": RESULT}),
        "And tomorrow?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"],
    "qwen2_5": [
        "<|im_start|>system\nYou are a weather bot.\n\n# Tools\n",
        "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>",
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n",
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' + CALL_JSON
        + "}\n</tool_call><|im_end|>\n",
        "<|im_start|>user\n<tool_response>\n" + RESULT + "\n</tool_response><|im_end|>\n",
        "<|im_start|>assistant\nSunny, 22 degrees.<|im_end|>\n",
        "<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n"],
    "qwen3": [
        "<|im_start|>system\nYou are a weather bot.\n\n# Tools\n",
        "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>",
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' + CALL_JSON
        + "}\n</tool_call><|im_end|>\n",
        "<|im_start|>user\n<tool_response>\n" + RESULT + "\n</tool_response><|im_end|>\n",
        "<|im_start|>assistant\nSunny, 22 degrees.<|im_end|>\n",
        "And tomorrow?<|im_end|>\n<|im_start|>assistant\n"],
    "qwen3_coder": [
        "<|im_start|>system\nYou are a weather bot.\n\n# Tools\n",
        "<function>\n<name>get_weather</name>\n<description>The forecast for a city."
        "</description>\n<parameters>\n<parameter>\n<name>city</name>\n<type>string</type>",
        "<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>\n",
        "<|im_start|>user\n<tool_response>\n" + RESULT + "\n</tool_response>\n<|im_end|>\n",
        "And tomorrow?<|im_end|>\n<|im_start|>assistant\n"],
    "mistral_v0_3": [
        "<s>[INST] Weather in Paris?[/INST]",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + CALL_JSON
        + ', "id": "abcDEF123"}]</s>',
        '[TOOL_RESULTS] {"content": ' + RESULT + ', "call_id": "abcDEF123"}[/TOOL_RESULTS]',
        " Sunny, 22 degrees.</s>",
        '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", '
        '"description": "The forecast for a city.", "parameters": ',
        "[/AVAILABLE_TOOLS][INST] You are a weather bot.\n\nAnd tomorrow?[/INST]"],
    "magistral": [
        "<s>[SYSTEM_PROMPT]You are a weather bot.[/SYSTEM_PROMPT]",
        "[AVAILABLE_TOOLS]" + json.dumps([WEATHER_TOOL]) + "[/AVAILABLE_TOOLS]",
        "[INST]Weather in Paris?[/INST][TOOL_CALLS]get_weather[ARGS]" + CALL_JSON + "</s>",
        "[TOOL_RESULTS]" + RESULT + "[/TOOL_RESULTS]Sunny, 22 degrees.</s>",
        "[INST]And tomorrow?[/INST]"],
    "deepseek_r1_distill_qwen": [
        "<｜begin▁of▁sentence｜>You are a weather bot.<｜User｜>Weather in Paris?",
        "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
        "get_weather\n```json\n" + CALL_JSON + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
        "<｜end▁of▁sentence｜>",
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>" + RESULT + "<｜tool▁output▁end｜>"
        "<｜tool▁outputs▁end｜>Sunny, 22 degrees.<｜end▁of▁sentence｜>",
        "<｜User｜>And tomorrow?<｜Assistant｜><think>\n"],
    "gemma3": [
        "<bos><start_of_turn>user\nYou are a weather bot.\n\nTools (functions) are available.",
        '"name": "get_weather"',
        "Weather in Paris?<end_of_turn>\n",
        '<start_of_turn>model\n[get_weather(city="Paris", days=3)]<end_of_turn>\n',
        "<start_of_turn>user\n<tool_response>\n" + RESULT + "</tool_response><end_of_turn>\n",
        "<start_of_turn>model\nSunny, 22 degrees.<end_of_turn>\n",
        "<start_of_turn>user\nAnd tomorrow?<end_of_turn>\n<start_of_turn>model\n"],
    "phi4_mini": [
        "<|system|>You are a weather bot.<|tool|>" + json.dumps([WEATHER_TOOL["function"]])
        + "<|/tool|><|end|>",
        "<|user|>Weather in Paris?<|end|>",
        '<|assistant|>functools[{"name": "get_weather", "arguments": ' + CALL_JSON + "}]<|end|>",
        "<|tool|>" + RESULT + "<|end|><|assistant|>Sunny, 22 degrees.<|end|>",
        "<|user|>And tomorrow?<|end|><|assistant|>"],
}


def call_arguments(family: str) -> object:
    """R1-distill's template pastes the arguments in as text; the others take an object."""
    return CALL_JSON if family == "deepseek_r1_distill_qwen" else None


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_conversation_renders_as_the_family_renders_it(chat_tokenizers, name):
    family = FAMILIES[name]
    text = render(chat_tokenizers[name], conversation(family, call_arguments(name)),
                  tools=[WEATHER_TOOL], add_generation_prompt=True, **DATE)
    at = 0
    for piece in EXPECTED[name]:
        found = text.find(piece, at)
        assert found >= 0, f"{name}: {piece!r} not found after position {at} in\n{text}"
        at = found + len(piece)
    assert text.endswith(EXPECTED[name][-1])


def test_every_family_has_its_expectations():
    assert set(EXPECTED) == set(FAMILIES)


def raises_template_error(tokenizer, messages, message, **kwargs):
    with pytest.raises(TemplateError) as raised:
        render(tokenizer, messages, **kwargs)
    assert str(raised.value) == message


def test_llama3_1_refuses_parallel_calls_and_tools_without_a_user_turn(chat_tokenizers):
    family, tokenizer = FAMILIES["llama3_1"], chat_tokenizers["llama3_1"]
    messages = conversation(family)
    messages[2]["tool_calls"] = messages[2]["tool_calls"] * 2
    raises_template_error(tokenizer, messages,
                          "This model only supports single tool-calls at once!")
    raises_template_error(tokenizer, messages[:1], "Cannot put tools in the first user message "
                          "when there's no first user message!", tools=[WEATHER_TOOL])
    # with the tools in the system turn, a system turn alone is fine
    assert render(tokenizer, messages[:1], tools=[WEATHER_TOOL], tools_in_user_message=False)


def test_llama3_2_puts_tools_in_the_system_turn_unless_told_otherwise(chat_tokenizers):
    tokenizer = chat_tokenizers["llama3_2"]
    system_only = [{"role": "system", "content": "Be brief."}]
    assert "python list of the calls" in render(tokenizer, system_only, tools=[WEATHER_TOOL])
    raises_template_error(tokenizer, system_only, "Cannot put tools in the first user message "
                          "when there's no first user message!", tools=[WEATHER_TOOL],
                          tools_in_user_message=True)


def test_llama3_2_writes_python_literals(chat_tokenizers):
    family = FAMILIES["llama3_2"]
    arguments = {"city": "Paris", "metric": True, "hours": [1, 2], "note": None}
    text = render(chat_tokenizers["llama3_2"], conversation(family, arguments)[:3], **DATE)
    assert '[get_weather(city="Paris", metric=True, hours=[1, 2], note=None)]' in text


def test_mistral_v0_3_refuses_ids_that_are_not_9_long(chat_tokenizers):
    family, tokenizer = FAMILIES["mistral_v0_3"], chat_tokenizers["mistral_v0_3"]
    message = "Tool call IDs should be alphanumeric strings with length 9!"
    no_result_id = conversation(family)
    del no_result_id[3]["tool_call_id"]
    raises_template_error(tokenizer, no_result_id, message)
    long_call_id = conversation(family)
    long_call_id[2]["tool_calls"][0]["id"] = "call_0123456789abcdef01234567"
    raises_template_error(tokenizer, long_call_id, message)


def test_mistral_v0_3_refuses_turns_out_of_order_and_unknown_roles(chat_tokenizers):
    tokenizer = chat_tokenizers["mistral_v0_3"]
    raises_template_error(tokenizer, [{"role": "user", "content": "a"}] * 2,
                          "After the optional system message, conversation roles must alternate "
                          "user/assistant/user/assistant/...")
    raises_template_error(tokenizer, [{"role": "user", "content": "a"},
                                      {"role": "developer", "content": "b"}],
                          "Only user and assistant roles are supported, with the exception of an "
                          "initial optional system message!")


def test_magistral_needs_no_ids_but_refuses_what_its_template_refuses(chat_tokenizers):
    family, tokenizer = FAMILIES["magistral"], chat_tokenizers["magistral"]
    messages = conversation(family)
    del messages[3]["tool_call_id"]
    assert "[TOOL_RESULTS]" + RESULT + "[/TOOL_RESULTS]" in render(tokenizer, messages)
    raises_template_error(tokenizer, [{"role": "user", "content": "a"}] * 2,
                          "After the optional system message, conversation roles must alternate "
                          "user and assistant roles except for tool calls and results.")
    raises_template_error(tokenizer, [{"role": "user", "content": "a"},
                                      {"role": "assistant", "content": ""}],
                          "Assistant message must have a string content or a list of chunks.")


def test_magistral_keeps_thinking_chunks_in_every_turn(chat_tokenizers):
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "Add."},
                                                  {"type": "text", "text": "4"}]},
                {"role": "user", "content": "3+3?"}]
    text = render(chat_tokenizers["magistral"], messages)
    assert text.endswith("[INST]2+2?[/INST][THINK]Add.[/THINK]4</s>[INST]3+3?[/INST]")
    assert "[SYSTEM_PROMPT]First draft your thinking process" in text  # the default prompt


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3", "qwen3_coder", "phi4_mini"])
def test_hermes_style_templates_need_no_name_or_id_on_a_result(chat_tokenizers, name):
    messages = conversation(FAMILIES[name])
    del messages[3]["tool_call_id"], messages[3]["name"]
    assert RESULT in render(chat_tokenizers[name], messages, tools=[WEATHER_TOOL])


def test_qwen3_coder_refuses_arguments_given_as_text(chat_tokenizers):
    family = FAMILIES["qwen3_coder"]
    with pytest.raises(TypeError, match="mapping"):
        render(chat_tokenizers["qwen3_coder"], conversation(family, CALL_JSON))


def test_r1_pastes_arguments_as_text_and_refuses_an_object(chat_tokenizers):
    family = FAMILIES["deepseek_r1_distill_qwen"]
    with pytest.raises(TypeError, match="concatenate"):
        render(chat_tokenizers[family.name], conversation(family, CALL_ARGUMENTS))


def test_gemma3_refuses_turns_out_of_order_and_odd_content(chat_tokenizers):
    tokenizer = chat_tokenizers["gemma3"]
    raises_template_error(tokenizer, [{"role": "user", "content": "a"}] * 2,
                          "Conversation roles must alternate user/assistant/user/assistant/...")
    raises_template_error(tokenizer, [{"role": "user", "content": 42}], "Invalid content type")


def test_qwen3_generation_prompt_with_and_without_thinking(chat_tokenizers):
    tokenizer, ask = chat_tokenizers["qwen3"], [{"role": "user", "content": "Hi"}]
    thinking = render(tokenizer, ask, add_generation_prompt=True)
    assert thinking.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    quiet = render(tokenizer, ask, add_generation_prompt=True, enable_thinking=False)
    assert quiet == thinking + "<think>\n\n</think>\n\n"


def test_qwen3_keeps_reasoning_only_after_the_last_user_query(chat_tokenizers):
    family, tokenizer = FAMILIES["qwen3"], chat_tokenizers["qwen3"]
    messages = conversation(family, reasoning="\nI should look it up.\n")
    in_tool_loop = render(tokenizer, messages[:4], tools=[WEATHER_TOOL])
    assert ("<|im_start|>assistant\n<think>\nI should look it up.\n</think>\n\n<tool_call>\n"
            in in_tool_loop)
    assert "I should look it up." not in render(tokenizer, messages, tools=[WEATHER_TOOL])
    # reasoning written inside the content is split out of it the same way
    messages[4]["content"] = "<think>\nIt is sunny.\n</think>\n\nSunny, 22 degrees."
    last_turn = render(tokenizer, messages[:5])
    assert last_turn.endswith("<|im_start|>assistant\n<think>\nIt is sunny.\n</think>\n\n"
                              "Sunny, 22 degrees.<|im_end|>\n")
    assert "It is sunny." not in render(tokenizer, messages)


def test_r1_opens_thinking_and_drops_earlier_reasoning(chat_tokenizers):
    tokenizer = chat_tokenizers["deepseek_r1_distill_qwen"]
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
                {"role": "user", "content": "3+3?"}]
    text = render(tokenizer, messages, add_generation_prompt=True)
    assert text == ("<｜begin▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜>\n\n4<｜end▁of▁sentence｜>"
                    "<｜User｜>3+3?<｜Assistant｜><think>\n")
    # after tool outputs the real template writes no generation prompt
    family = FAMILIES["deepseek_r1_distill_qwen"]
    after_tool = render(tokenizer, conversation(family, CALL_JSON)[:4], add_generation_prompt=True)
    assert after_tool.endswith("<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_tokens_are_special_as_the_family_marks_them(chat_tokenizers, name):
    family, tokenizer = FAMILIES[name], chat_tokenizers[name]
    flags = {t.content: t.special for t in tokenizer.added_tokens_decoder.values()}
    for token in family.tokens:
        assert flags[token.content] is token.special, token
        ids = tokenizer.encode(f"a{token.content}b", add_special_tokens=False)
        assert tokenizer.convert_tokens_to_ids(token.content) in ids  # one token, not pieces
        kept = tokenizer.decode(ids, skip_special_tokens=True)
        assert kept == ("ab" if token.special else f"a{token.content}b"), token


def test_the_families_mark_their_markers_as_documented():
    """The flags the parsers' docstrings rely on: Qwen's markers survive skip_special_tokens,
    Mistral's, Llama's and Phi's do not."""
    assert not any(FAMILIES["qwen3"].special(t) for t in ("<think>", "</think>", "<tool_call>"))
    assert not FAMILIES["deepseek_r1_distill_qwen"].special("<think>")
    assert all(FAMILIES["magistral"].special(t) for t in ("[TOOL_CALLS]", "[ARGS]", "[THINK]"))
    assert all(FAMILIES["llama3_1"].special(t)
               for t in ("<|python_tag|>", "<|eot_id|>", "<|start_header_id|>"))
    assert FAMILIES["phi4_mini"].special("<|tool_call|>")
