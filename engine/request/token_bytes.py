"""Each token's bytes, for the detokenizer's fastest path on byte-level tokenizers.

A ByteLevel decoder (GPT-2, Llama 3, Qwen, Mistral's tekken) renders a token as fixed bytes,
wherever it stands: each character of the token names one byte (GPT-2's printable alphabet), and
the text of a run of tokens is its bytes concatenated, decoded as UTF-8 with U+FFFD for what is
not (Rust's from_utf8_lossy). The detokenizer's window rule, "emit the new text once it is longer
and does not end in U+FFFD", then needs no decode of a window: a step's text is the bytes it
holds plus the token's, decoded, and most tokens are whole characters whose text is looked up.
At batch 128 that is ~1.2 us a row in the engine where DecodeStream's step took ~3.4.

Whether a tokenizer's decode is this byte model is checked, not assumed (`table_for` compares
the model's text with the tokenizer's own decode over random runs of ids, special tokens
included); a tokenizer that differs keeps DecodeStream or the window path.
"""

from __future__ import annotations

import json
import random
import weakref
from dataclasses import dataclass

REPLACEMENT_CHAR = "\ufffd"


def _byte_of_char() -> dict[str, int]:
    """GPT-2's alphabet: printable Latin-1 bytes stand for themselves, the other 68 bytes for
    the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


BYTE_OF_CHAR = _byte_of_char()


@dataclass(frozen=True)
class TokenBytes:
    bytes: list[bytes]  # by token id: what it renders
    text: list[str | None]  # its text where that is a whole, non-empty text (else None)
    special: frozenset[int]  # special tokens: nothing when skip_special_tokens
    text_skipping: list[str | None]  # `text` with the special tokens None

    def texts(self, skip_special_tokens: bool) -> list[str | None]:
        """What a token's text is looked up in, with or without skip_special_tokens."""
        return self.text_skipping if skip_special_tokens else self.text


def token_bytes(token: str) -> bytes:
    """ByteLevel's rendering of one token (a character outside the alphabet: the token's own
    UTF-8, as the Rust decoder does)."""
    try:
        return bytes(BYTE_OF_CHAR[c] for c in token)
    except KeyError:
        return token.encode()


def bytes_of(table: TokenBytes, ids: list[int], skip_special_tokens: bool) -> bytes:
    """What `ids` render in the byte model, before decoding."""
    skipped = table.special if skip_special_tokens else frozenset()
    return b"".join(table.bytes[i] for i in ids if i not in skipped)


def render(table: TokenBytes, ids: list[int], skip_special_tokens: bool) -> str:
    """The text of `ids` in the byte model."""
    return bytes_of(table, ids, skip_special_tokens).decode("utf-8", "replace")


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend -> its table


def table_for(backend) -> TokenBytes | None:
    """The byte table of a tokenizers.Tokenizer (or None) whose decode it reproduces, else None
    (made once per tokenizer: ~0.4 s for a 150k vocabulary, at the engine's start)."""
    if backend is None:
        return None
    if backend not in _TABLES:
        _TABLES[backend] = _build(backend)
    return _TABLES[backend]


def _build(backend) -> TokenBytes | None:
    if backend.decoder is None:
        return None
    try:
        decoder = json.loads(backend.decoder.__getstate__())
    except Exception:  # a custom Python decoder cannot be serialized
        return None
    if decoder.get("type") != "ByteLevel":
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    rendered = [b""] * size
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i < size:
            rendered[i] = token_bytes(token)
    special = frozenset(i for i, added in backend.get_added_tokens_decoder().items()
                        if added.special)
    text = [None] * size
    for i, data in enumerate(rendered):
        s = data.decode("utf-8", "replace")
        if s and not s.endswith(REPLACEMENT_CHAR):
            text[i] = s
    skipping = [None if i in special else t for i, t in enumerate(text)]
    table = TokenBytes(rendered, text, special, skipping)
    return table if _agrees(backend, table) else None


def _agrees(backend, table: TokenBytes, runs: int = 400) -> bool:
    """Whether the byte model gives the tokenizer's own text on random runs of ids (every
    special token among them), with and without skip_special_tokens."""
    rng = random.Random(0)
    size = len(table.bytes)
    for r in range(runs):
        ids = [rng.randrange(size) for _ in range(rng.randint(1, 16))]
        if r < len(table.special):
            ids.insert(rng.randrange(len(ids) + 1), sorted(table.special)[r])
        skip = r % 2 == 0
        if render(table, ids, skip) != backend.decode(ids, skip_special_tokens=skip):
            return False
    return True
