"""The detokenizer's token-bytes path (byte-level tokenizers) and Rust DecodeStream path
against its Python window path: the same deltas, flushed tail, stop reason and text, token for
token, over the decoder families LLMs ship.

Tokenizers are built here (no downloads): byte-level BPE (GPT-2, Llama 3, Qwen, Mistral's
tekken), and byte-fallback SentencePiece-style BPE with Llama's decoder (Llama 2, Mistral v0.1,
Phi-3), Gemma's (no leading-space strip) and a Metaspace decoder (other converted SentencePiece
models). Sequences are random ids over the whole vocabulary, so they hold special tokens, bare
byte tokens that never finish a character, and lone "▁" pieces; and encoded text with accents,
CJK and emoji, which a small vocabulary spells in bytes.
"""

from __future__ import annotations

import contextlib
import json
import random
from unittest.mock import patch

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import loragw.engine.request.detokenizer
from loragw.demo.model import build_tokenizer
from loragw.engine.request.decode_stream import DecodeStream, renders_stably
from loragw.engine.request.detokenizer import IncrementalDetokenizer
from loragw.engine.request.params import SamplingParams
from loragw.engine.request.token_bytes import table_for, token_bytes
from loragw.engine.request.tokenizer import load_tokenizer

LINES = ["hello world, hello there", "the stop word is STOP here", "héllo wörld wide web",
         "  two spaces and\ttabs\nnew lines", "numbers 12345 and symbols !?"] * 3
TEXTS = ["héllo wörld 日本語 🙂", "new text ünïcode 中文 😀👍 and more", "  lead spaces\n\nend  "]
SPECIALS = ["<unk>", "<s>", "</s>"]
LLAMA_DECODER = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                 decoders.Strip(" ", 1, 0)]


def byte_fallback_bpe(decoder, pre_tokenizer=None) -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE: spaces as "▁", unknown characters as <0xXX> byte tokens."""
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizer if pre_tokenizer is None else None
    base.pre_tokenizer = pre_tokenizer
    base.train_from_iterator(LINES, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                        show_progress=False))
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = base.normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def byte_level_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(LINES, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def word_piece() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(LINES, trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[UNK]", "[SEP]"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]")


def demo_tokenizer(tmp) -> PreTrainedTokenizerFast:
    """The demo model's: Qwen2's byte-level pipeline, four special tokens, BOS prepended."""
    build_tokenizer(str(tmp), vocab_size=600)
    return load_tokenizer(tmp)


needs_stream = pytest.mark.skipif(DecodeStream is None, reason="tokenizers < 0.22: no "
                                  "DecodeStream(ids=...), the window path serves every tokenizer")

# family -> (builder, whether DecodeStream serves it, whether the token-bytes path does)
FAMILIES = {
    "byte-level": (lambda tmp: byte_level_bpe(), True, True),
    "qwen-demo": (demo_tokenizer, True, True),
    "llama": (lambda tmp: byte_fallback_bpe(decoders.Sequence(LLAMA_DECODER)), True, False),
    "gemma": (lambda tmp: byte_fallback_bpe(decoders.Sequence(LLAMA_DECODER[:3])), True, False),
    "metaspace": (lambda tmp: byte_fallback_bpe(
        decoders.Metaspace(prepend_scheme="first"),
        pre_tokenizers.Metaspace(prepend_scheme="first")), True, False),
    "word-piece": (lambda tmp: word_piece(), False, False),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    build, streams, bytes_path = FAMILIES[request.param]
    return build(tmp_path_factory.mktemp(request.param)), streams, bytes_path


def run(tok, prompt, chunks, params, stream: bool, table: bool = False):
    """(deltas, flushed tail, stop reason, text, detokenizer) on one path: the token-bytes
    path (`table`, where the tokenizer has one), DecodeStream (`stream`) or the window."""
    with contextlib.ExitStack() as paths:
        if not table:
            paths.enter_context(patch("loragw.engine.request.detokenizer.table_for", return_value=None))
        if not stream:
            paths.enter_context(patch("loragw.engine.request.detokenizer.can_stream", return_value=False))
        detok = IncrementalDetokenizer(tok, prompt, params)
    # (a one-token chunk as a decode step gives it)
    deltas = [detok.step_token(c[0]) if len(c) == 1 else detok.step(c) for c in chunks]
    tail = detok.flush()
    return deltas, tail, detok.stop_reason, "".join(deltas) + tail, detok


def chunked(ids: list[int], rng: random.Random) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 4])  # mostly one token a step, as decoding goes
        chunks.append(ids[i:i + n])
        i += n
    return chunks


def random_case(tok, rng: random.Random):
    """(prompt, chunks, params): random or encoded ids, stop strings taken from the text."""
    vocab = len(tok)
    prompt = [rng.randrange(vocab) for _ in range(rng.choice([0, 1, 3, 8]))]
    if rng.random() < 0.5:
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
    else:
        ids = tok.encode(rng.choice(TEXTS) + " " + rng.choice(LINES), add_special_tokens=False)
    skip = rng.random() < 0.7
    text = tok.backend_tokenizer.decode(ids, skip_special_tokens=skip)
    stop = []
    for _ in range(rng.choice([0, 0, 1, 2])):
        start = rng.randrange(len(text) + 1)
        stop.append(text[start:start + rng.randint(1, 4)] or "\ufffd")
    params = SamplingParams(skip_special_tokens=skip, stop=stop, min_tokens=rng.choice([0, 0, 3]),
                            include_stop_str_in_output=rng.random() < 0.5)
    return prompt, chunked(ids, rng), params


@pytest.mark.parametrize("seed", range(4))
def test_stream_and_bytes_paths_match_window_path(family, seed):
    tok, streams, bytes_path = family
    rng = random.Random(seed)
    tabled = 0
    for _ in range(150):
        prompt, chunks, params = random_case(tok, rng)
        *fast, detok = run(tok, prompt, chunks, params, stream=True)
        *window, _ = run(tok, prompt, chunks, params, stream=False)
        *table, by_table = run(tok, prompt, chunks, params, stream=False, table=True)
        assert fast == window, (prompt, chunks, params)
        assert table == window, (prompt, chunks, params)
        assert detok.streamable is (streams and DecodeStream is not None)
        tabled += by_table.table is not None
    # every case, random prompts that end inside a character included
    assert tabled == 150 if bytes_path else tabled == 0


@needs_stream
@pytest.mark.parametrize("text", TEXTS)
def test_stream_path_keeps_encoded_text_whole(family, text):
    tok, streams, _ = family
    ids = tok.encode(text, add_special_tokens=False)
    with patch("loragw.engine.request.detokenizer.table_for", return_value=None):
        detok = IncrementalDetokenizer(tok, [], SamplingParams())
    deltas = [detok.step([i]) for i in ids]
    assert (detok.stream is not None) is streams  # never had to leave it
    assert "".join(deltas) + detok.flush() == tok.backend_tokenizer.decode(ids)


@needs_stream
def test_byte_run_broken_by_a_later_byte_falls_back_then_reopens(tmp_path):
    """Llama's ByteFallback renders <0x41> as "A" but <0x41><0xE6> as two U+FFFD: emitted text
    changes, DecodeStream raises, the window path decodes that step, and a new stream goes on."""
    tok = FAMILIES["llama"][0](tmp_path)
    ids = tok.convert_tokens_to_ids(["▁the", "<0x41>", "<0xE6>", "▁the", "▁the"])
    assert tok.unk_token_id not in ids
    stream = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="(?i)invalid prefix"):
        for i in ids:
            stream.step(tok.backend_tokenizer, i)
    with patch("loragw.engine.request.detokenizer.open_decode_stream",
               wraps=loragw.engine.request.detokenizer.open_decode_stream) as opened:
        deltas, tail, *_ = run(tok, [], [[i] for i in ids], SamplingParams(), stream=True)
    assert opened.call_count == 2  # at the start, and after the window path's emission
    assert (deltas, tail) == run(tok, [], [[i] for i in ids], SamplingParams(), stream=False)[:2]
    assert "".join(deltas) == "theA\ufffd the the"  # what the window path always gave


@needs_stream
def test_prompt_ending_inside_a_character_starts_on_the_window_path(tmp_path):
    tok = FAMILIES["llama"][0](tmp_path)
    prompt = tok.convert_tokens_to_ids(["▁the", "<0xE6>", "<0x97>"])  # 日 is E6 97 A5
    ids = tok.encode("hello world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    assert detok.stream is None  # DecodeStream would take the prompt's text for new
    deltas = [detok.step([i]) for i in ids]
    assert detok.stream is not None  # opened after the first emission
    assert deltas == run(tok, prompt, [[i] for i in ids], SamplingParams(), stream=False)[0]
    assert "".join(deltas) == " hello world"


@pytest.mark.parametrize("tail", ["\u65e5", "\U0001f642"])  # 3 and 4 bytes
@pytest.mark.parametrize("cut", [1, 2, 3])
def test_a_prompt_ending_inside_a_character_keeps_the_bytes_path(tmp_path, tail, cut):
    """The prompt's unfinished character is the window's prefix: the first output bytes that
    finish it add only what the window path's decode adds (not the finished character)."""
    tok = FAMILIES["byte-level"][0](tmp_path)
    ids = tok.encode("héllo " + tail + " wörld" + tail, add_special_tokens=False)
    # a prompt of whole tokens that ends inside a character of the text
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    if len(cuts) < cut:
        pytest.skip(f"the tokenizer spells {tail!r} in fewer tokens")
    prompt, output = ids[:cuts[cut - 1]], ids[cuts[cut - 1]:]
    for chunks in ([[i] for i in output], [output]):
        *table, detok = run(tok, prompt, chunks, SamplingParams(), stream=False, table=True)
        assert detok.table is not None
        assert table == list(run(tok, prompt, chunks, SamplingParams(), stream=False)[:-1])


@pytest.mark.parametrize(("decoder", "stable"), [
    (decoders.ByteLevel(), True),
    (decoders.Metaspace(), True),
    (decoders.Sequence(LLAMA_DECODER), True),
    (decoders.Sequence(LLAMA_DECODER[:3]), True),
    (decoders.Strip(" ", 2, 0), False),  # could strip into a later token's text
    (decoders.Strip(" ", 0, 1), False),
    (decoders.WordPiece(), False),  # its clean-up rewrites " ." as "."
    (decoders.CTC(), False),  # merges repeats across tokens
    (decoders.BPEDecoder(), False),
    (decoders.Sequence([decoders.ByteFallback(), decoders.WordPiece()]), False),
])
def test_renders_stably(decoder, stable):
    assert renders_stably(decoder.__getstate__()) is stable


def test_tokenizer_without_a_decoder_keeps_the_window_path():
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    detok = IncrementalDetokenizer(PreTrainedTokenizerFast(tokenizer_object=tok), [],
                                   SamplingParams())
    assert detok.stream is None and detok.step([0, 1]) + detok.flush() == "a b"


def test_the_bytes_path_serves_only_where_it_reproduces_decode():
    tok = byte_level_bpe()
    wrong = {tok.convert_ids_to_tokens(tok.encode("e", add_special_tokens=False)[0])}
    with patch("loragw.engine.request.token_bytes.token_bytes",
               side_effect=lambda t: b"?" if t in wrong else token_bytes(t)):
        assert table_for(tok.backend_tokenizer) is None  # its check caught the wrong byte
        detok = IncrementalDetokenizer(tok, [], SamplingParams())
    assert detok.table is None and detok.stream is not None  # DecodeStream serves instead
    fresh = byte_level_bpe()
    assert table_for(fresh.backend_tokenizer) is not None


def test_ids_past_the_tokenizer_render_nothing_on_every_path():
    """A padded embedding (Qwen's 151936 rows for 151665 tokens) can sample an id the
    tokenizer lacks: its decode skips it, and so does each path."""
    tok = byte_level_bpe()
    ids = tok.encode("hello world", add_special_tokens=False)
    ids = ids[:2] + [len(tok) + 7] + ids[2:]
    paths = [run(tok, [], [[i] for i in ids], SamplingParams(), stream=s, table=t)[:2]
             for s, t in ((False, False), (True, False), (False, True))]
    assert paths[0] == paths[1] == paths[2]
    assert "".join(paths[0][0]) + paths[0][1] == "hello world"
