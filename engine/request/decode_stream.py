"""When the Rust `tokenizers.decoders.DecodeStream` may stand in for the detokenizer's window.

DecodeStream keeps the same window as engine/request/detokenizer.py (the ids from the prefix offset
on, and the text of those before the read offset) and applies the same rule to each token:
emit the text past the prefix once the window decodes longer and does not end in U+FFFD. It
differs in three places, each made harmless here or by the detokenizer:

- It measures length in bytes, not characters, and raises InvalidPrefix when the longer text
  does not begin with the prefix. The two agree while the decoder keeps the text of earlier
  tokens as later ones arrive (`renders_stably`). The one rewrite such decoders make,
  ByteFallback turning a valid run of byte tokens into one U+FFFD per byte once a byte joins
  that breaks it, lengthens the text in bytes too, so it always raises; the detokenizer then
  decodes that step's window itself, and opens a new stream after its next emission.
- A new stream's prefix text is that of the ids it is given only if it does not end in
  U+FFFD; otherwise it is empty, and the stream would emit their text again. Such a window
  (a prompt tail ending inside a character) is decoded in Python until its next emission.
- While its prefix text is empty it moves the read offset past tokens held since. With a
  stable decoder that changes which token starts a later window, never the text: the token
  that last emitted is always in the prefix, so what a window's first token renders
  differently (Metaspace's dropped "▁", Strip's one leading space) stays in the prefix.
"""

from __future__ import annotations

import functools
import json

try:  # DecodeStream takes the prompt's ids since tokenizers 0.22; older ones keep the window
    from tokenizers.decoders import DecodeStream

    DecodeStream(ids=[], skip_special_tokens=False)
except (ImportError, TypeError):
    DecodeStream = None

REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence
# Decoders whose text for a token does not depend on the tokens after it (Fuse only joins;
# ByteFallback's one exception is described above).
PER_TOKEN_DECODERS = frozenset({"ByteLevel", "Metaspace", "Replace", "ByteFallback", "Fuse"})


def can_stream(backend) -> bool:
    """Whether DecodeStream gives the window path's text for this tokenizer's decoder.
    `backend`: a tokenizers.Tokenizer, or None (a tokenizer without one decodes in Python)."""
    return DecodeStream is not None and backend is not None and renders_stably(
        _decoder_json(backend))


def open_decode_stream(backend, window: list[int], skip_special_tokens: bool):
    """A DecodeStream holding `window` (the ids from the prefix offset on, all read), or None
    while their text ends in U+FFFD: it would take that text for new (see above)."""
    if backend.decode(window, skip_special_tokens=skip_special_tokens).endswith(REPLACEMENT_CHAR):
        return None
    return DecodeStream(ids=window, skip_special_tokens=skip_special_tokens)


def _decoder_json(backend) -> bytes | None:
    if backend.decoder is None:  # tokens joined by " ": left to the window path
        return None
    try:
        return backend.decoder.__getstate__()
    except Exception:  # a custom Python decoder cannot be serialized
        return None


@functools.lru_cache(maxsize=16)
def renders_stably(decoder_json: bytes | None) -> bool:
    """Whether the decoder (as serialized) keeps the text of earlier tokens as later ones
    arrive, but for the ByteFallback rewrite that DecodeStream reports."""
    return decoder_json is not None and _stable(json.loads(decoder_json))


def _stable(decoder: dict) -> bool:
    kind = decoder["type"]
    if kind == "Sequence":
        return all(_stable(d) for d in decoder["decoders"])
    if kind == "Strip":
        # Stripping the end, or more than one leading character, can reach past a window's
        # first token into text the two paths split differently (Llama's is Strip(" ", 1, 0)).
        return decoder["start"] <= 1 and decoder["stop"] == 0
    return kind in PER_TOKEN_DECODERS
