"""Detokenizer and tokenizer loading, on a small byte-level BPE built here (no downloads).

The tokenizer learns whole words from its training lines, so unseen text such as "中文 😀"
falls apart into single-byte tokens: exactly the case where a naive streamer would emit U+FFFD.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from loragw.engine.request.detokenizer import IncrementalDetokenizer
from loragw.engine.request.params import SamplingParams
from loragw.engine.request.tokenizer import encode_chat, load_tokenizer

TRAINING_LINES = [
    "héllo wörld 日本語 🙂",
    "hello world, hello there",
    "the stop word is STOP here",
    "日本語のテキスト 🙂🙂 emoji",
    "wörld wide web héllo",
] * 3
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if tools %}tools: {{ tools | length }}\n{% endif %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TEXTS = [
    "héllo wörld 日本語 🙂",
    "new text ünïcode 中文 😀👍 and more",
    "🙂🙂🙂 日本語のテキスト wörld",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(TRAINING_LINES, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def random_split(ids: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        chunks.append(ids[i:i + n])
        i += n
    return chunks


def stream(tok, chunks: list[list[int]], prompt: list[int] = (), **params):
    """(deltas per step, flushed tail, detokenizer), checking the prefix invariant on the way."""
    detok = IncrementalDetokenizer(tok, list(prompt), SamplingParams(**params))
    deltas = []
    for chunk in chunks:
        # (a one-token chunk as a decode step gives it)
        deltas.append(detok.step_token(chunk[0]) if len(chunk) == 1 else detok.step(chunk))
    return deltas, detok.flush(), detok


SPLITS = [("one-per-token", None)] + [(f"random-{s}", s) for s in range(8)]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize(("name", "seed"), SPLITS)
def test_deltas_concatenate_to_full_decode(tok, text, name, seed):
    ids = encode(tok, text)
    chunks = [[i] for i in ids] if seed is None else random_split(ids, seed)
    deltas, tail, detok = stream(tok, chunks)
    assert "".join(deltas) + tail == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas + [tail])
    assert detok.stop_reason is None


def test_multibyte_character_is_emitted_whole(tok):
    ids = encode(tok, " 😀")
    assert len(ids) > 2  # split into byte tokens, so the character spans several steps
    deltas, tail, _ = stream(tok, [[i] for i in ids])
    assert "😀" in deltas and tail == ""
    assert "".join(deltas) == " 😀"


def test_prompt_context_does_not_leak_into_output(tok):
    prompt, output = encode(tok, "hello there héllo"), encode(tok, " wörld 日本語 🙂")
    deltas, tail, _ = stream(tok, [[i] for i in output], prompt=prompt)
    assert "".join(deltas) + tail == tok.decode(output)


def test_long_output_keeps_a_small_decode_window(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    for i in encode(tok, "hello world, hello there " * 40):
        detok.step([i])
        assert len(detok.tokens) - detok.prefix_offset <= 3  # O(1) work per token


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok, skip):
    ids = encode(tok, "hello world") + [tok.eos_token_id]
    deltas, tail, _ = stream(tok, [[i] for i in ids], skip_special_tokens=skip)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)
    assert ("</s>" in "".join(deltas) + tail) is not skip


STOP_TEXT = "new text ünïcode 中文 😀👍 and more"


@pytest.mark.parametrize("stop", ["中文", "code", "😀👍 a", "e"])
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(("name", "seed"), SPLITS)
def test_stop_string_is_never_leaked(tok, stop, include, name, seed):
    ids = encode(tok, STOP_TEXT)
    chunks = [[i] for i in ids] if seed is None else random_split(ids, seed)
    deltas, tail, detok = stream(tok, chunks, stop=[stop], include_stop_str_in_output=include)
    index = STOP_TEXT.index(stop)
    expected = STOP_TEXT[:index + len(stop)] if include else STOP_TEXT[:index]
    assert detok.stop_reason == stop
    assert "".join(deltas) + tail == expected
    assert tail == ""  # flush never releases a matched stop string
    if not include:
        # No prefix of the stream ever showed any part of the stop string.
        shown = ""
        for d in deltas:
            shown += d
            assert expected.startswith(shown)


def test_steps_after_a_stop_emit_nothing(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["world"]))
    assert detok.step(encode(tok, "hello world, hello")) == "hello "
    assert detok.step(encode(tok, " there")) == ""
    assert detok.flush() == "" and detok.stop_reason == "world"


def test_earliest_stop_string_wins(tok):
    deltas, tail, detok = stream(tok, [encode(tok, "new text and more")], stop=["more", "text"])
    assert detok.stop_reason == "text" and "".join(deltas) + tail == "new "


@pytest.mark.parametrize("stops", [["wor", "w"], ["w", "wor"]])
def test_stop_strings_at_one_index_the_first_listed_wins(tok, stops):
    deltas, tail, detok = stream(tok, [encode(tok, "hello world")], stop=stops)
    assert detok.stop_reason == stops[0] and "".join(deltas) + tail == "hello "


def test_possible_stop_beginning_is_held_then_released(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["world"]))
    assert detok.step(encode(tok, "hello wor")) == "hello "  # "wor" may begin "world"
    assert detok.step(encode(tok, "ds")) == "words"
    assert detok.step(encode(tok, " wo")) == " "
    assert detok.flush() == "wo"  # finished for another reason: nothing is held forever
    assert detok.stop_reason is None


def test_min_tokens_holds_off_stop_strings(tok):
    first = encode(tok, "hello world,")  # "hello" here is inside the first min_tokens tokens
    ids = first + encode(tok, " hello there")
    deltas, tail, detok = stream(tok, [[i] for i in ids], stop=["hello"],
                                 min_tokens=len(first))
    assert "".join(deltas[:len(first)]) == "hello world,"  # nothing held back meanwhile
    assert detok.stop_reason == "hello" and "".join(deltas) + tail == "hello world, "
    assert tail == ""


def test_text_shown_within_min_tokens_is_never_held_back_later():
    """"hel" is shown inside min_tokens; "l" then makes "hell", a beginning of "hello" whose
    first three characters are out already: only unshown text may be held back."""
    words = Tokenizer(models.WordLevel({"hel": 0, "l": 1, "o": 2, "!": 3}, unk_token="!"))
    words.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=words)
    deltas, tail, detok = stream(tok, [[0], [1], [2], [3]], stop=["hello"], min_tokens=1)
    assert deltas == ["hel", "l", "o", "!"] and tail == ""
    assert detok.stop_reason is None  # it began before stop strings were looked for


def test_load_tokenizer_round_trips(tok):
    for text in TEXTS:
        assert tok.decode(encode(tok, text)) == text


def test_load_tokenizer_missing_directory_says_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_encode_chat_renders_template_without_doubling_bos(tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 🙂"}]
    ids = encode_chat(tok, messages)
    assert tok.decode(ids) == "<s>system: be brief\n<s>user: héllo 🙂\nassistant:"
    assert ids.count(tok.bos_token_id) == 2  # one per message, none added by encode
    assert ids[-len(encode(tok, "assistant:")):] == encode(tok, "assistant:")
    without = encode_chat(tok, messages, add_generation_prompt=False)
    assert tok.decode(without).endswith("héllo 🙂\n")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert tok.decode(encode_chat(tok, messages, tools=tools)).endswith("tools: 1\nassistant:")


def test_encode_chat_without_template_is_a_clear_error(tok):
    bare = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer)
    with pytest.raises(ValueError, match="no chat template"):
        encode_chat(bare, [{"role": "user", "content": "hi"}])
