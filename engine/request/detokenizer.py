"""Generated token ids -> streamed text deltas, with stop strings cut out.

Incremental decoding after vLLM: keep two offsets into the token list, `prefix_offset` and
`read_offset`. The text of tokens[prefix:read] has been emitted already; decoding
tokens[prefix:] and dropping that known prefix gives the new text. Decoding a few tokens of
context (rather than the new token alone) keeps tokenizers that render a token differently at
the start of a string (SentencePiece's leading space) correct, and the window stays a handful of
tokens long, so each token costs O(1) however long the output grows.

The `tokenizers` library runs this same algorithm in Rust (`decoders.DecodeStream`, see
engine/request/decode_stream.py for where it gives the same text): one call per token instead of two
decodes from Python, half the cost. Where it might not, the window is decoded here. A
byte-level tokenizer needs neither: the same rule over each token's bytes (engine/request/token_bytes.py)
costs a lookup for most tokens, and keeps only the bytes of an unfinished character (and the
window's prefix while that may end inside one, as a prompt cut inside a character does).
`prefix_offset` / `read_offset` move the same on the other two paths, so `flush`, and a switch
between them in the middle of a stream, find the window where the other left it.
"""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase

from loragw.engine.request.decode_stream import REPLACEMENT_CHAR, can_stream, open_decode_stream
from loragw.engine.request.params import SamplingParams
from loragw.engine.request.token_bytes import bytes_of, table_for

# How many prompt tokens seed the first window, as vLLM does.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """One request's output text. `step` per engine step, `flush` once at finish."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 params: SamplingParams):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)  # tokenizers.Tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop)
        # One search for them all: the leftmost match, and at one index the one listed first.
        self.stop_pattern = re.compile("|".join(map(re.escape, self.stop))) if self.stop else None
        self.include_stop = params.include_stop_str_in_output
        # Stop strings are looked for only in text that arrives after the first min_tokens
        # tokens (text those tokens made is never cut off or held back).
        self.min_tokens = params.min_tokens
        # The characters a proper prefix of a stop string can end with: text ending otherwise
        # holds nothing back, the common case, checked without a search.
        self.stop_prefix_ends = frozenset(c for s in self.stop for c in s[:-1])
        self.num_tokens = 0  # output tokens seen
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.tokens = context  # prompt tail, then every output token
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.pending = ""  # stable text not emitted yet (what may begin a stop string)
        self.stop_reason: str | None = None
        # A byte-level tokenizer's token bytes (engine/request/token_bytes.py): the fastest path.
        self.table = table_for(self.backend)
        self.held = b""  # the table path's bytes not yet emitted (an unfinished character)
        # The table path's window prefix (the bytes of tokens[prefix_offset:read_offset]) where
        # it may end inside a character: the window rule then decodes it with what follows. Else
        # b"": text after a whole character decodes the same without it.
        self.prefix = b""
        if self.table is not None:
            context_bytes = bytes_of(self.table, context, self.skip_special_tokens)
            if _may_end_inside(context_bytes):
                self.prefix = context_bytes
        self.skipped = (self.table.special if self.table and self.skip_special_tokens
                        else frozenset())
        # where the table path looks a token's text up (None off that path)
        self.texts = self.table.texts(self.skip_special_tokens) if self.table else None
        # Rust's copy of the window, or None while the window is decoded from here.
        self.streamable = self.table is None and can_stream(self.backend)
        self.stream = None
        if self.streamable:
            self._open_stream()

    def step(self, new_token_ids: list[int]) -> str:
        """Add generated tokens; return the text newly safe to show."""
        if self.stop_reason is not None:
            return ""
        self.num_tokens += len(new_token_ids)
        for token_id in new_token_ids:
            self._advance(token_id)
        return self._emit(final=False)

    def step_token(self, token_id: int) -> str:
        """`step([token_id])`, as a decode step calls it: without a stop string to look for,
        most tokens' text is a lookup (the bytes path) and nothing is held back."""
        if self.stop_reason is not None:
            return ""
        self.num_tokens += 1
        if self.stop:
            self._advance(token_id)
            return self._emit(final=False)
        texts = self.texts
        if texts is not None and not self.held and not self.prefix and token_id < len(texts):
            new_text = texts[token_id]  # a whole character or more: the common case
            if new_text is not None:
                return new_text
        new_text = self._advance(token_id)
        if new_text is None:
            return ""
        self.pending = ""  # = _emit's delta, without its search
        return new_text

    def flush(self) -> str:
        """At finish: release held-back text, including any incomplete bytes as U+FFFD."""
        if self.stop_reason is not None:
            return ""
        if self.table is not None:
            self.pending += _after(self.prefix, self.held)
        elif self.read_offset < len(self.tokens):  # some tokens are held
            prefix_text, new_text = self._window()
            self.pending += new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.stream, self.held, self.prefix = None, b"", b""  # their window is not this one now
        return self._emit(final=True)

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of spaces: it is not concatenation-safe across windows (and is a no-op for
        # the BPE tokenizers LLMs use). A fast tokenizer's own Rust decode is what
        # transformers' decode calls then; called directly it costs a third (2 vs 7 µs), and
        # the window path runs it twice per token.
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _window(self) -> tuple[str, str]:
        prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset:])
        return prefix_text, new_text

    def _advance(self, token_id: int) -> str | None:
        """Move the new stable text into `pending` and slide the window past it; returns that
        text (None while the token is held)."""
        if self.table is not None:  # its held bytes are all its state: no window to slide
            new_text = self._table_step(token_id)
            if new_text is not None:
                self.pending += new_text
            return new_text
        self.tokens.append(token_id)
        if self.stream is None:
            new_text = self._window_step()
        else:
            try:
                new_text = self.stream.step(self.backend, token_id)
            except Exception:  # its one error, InvalidPrefix, is not the caller's to see
                # The decoder rewrote text already emitted (byte-fallback bytes that stopped
                # forming a character): the window path decodes this step as it always did.
                self.stream = None
                new_text = self._window_step()
        if new_text is None:
            return None
        self.pending += new_text
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        if self.stream is None and self.streamable:
            self._open_stream()
        return new_text

    def _open_stream(self) -> None:
        # Only where the read offset is at the end, as a new DecodeStream's is: at the start and
        # right after text was emitted.
        self.stream = open_decode_stream(self.backend, self.tokens[self.prefix_offset:],
                                         self.skip_special_tokens)

    def _table_step(self, token_id: int) -> str | None:
        """The window rule in the byte model: the text the held bytes and the token's add to
        the prefix's; held while that is empty or ends in U+FFFD. (An id past the tokenizer's,
        as a padded vocabulary samples, renders nothing, as its decode gives.)"""
        texts = self.texts  # (step_token looks up the same, inline, for a decode step's token)
        if not self.held and not self.prefix and token_id < len(texts):
            text = texts[token_id]  # a whole character or more: the common case
            if text is not None:
                return text
        table = self.table
        known = token_id < len(table.bytes) and token_id not in self.skipped
        data = self.held + table.bytes[token_id] if known else self.held
        text = _after(self.prefix, data)
        if not text or text.endswith(REPLACEMENT_CHAR):
            self.held = data
            return None
        # the window slides past the emitted tokens: they are its prefix now
        self.held, self.prefix = b"", data if _may_end_inside(data) else b""
        return text

    def _window_step(self) -> str | None:
        """The newest token's stable text, or None while it is held."""
        prefix_text, new_text = self._window()
        # Hold while the token added nothing visible (a skipped special token) or the tail is an
        # unfinished multi-byte character; the window widens until the character completes.
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return None
        return new_text[len(prefix_text):]

    def _emit(self, final: bool) -> str:
        """Cut at the first stop string, else emit all but a possible stop-string beginning."""
        pending = self.pending
        if not self.stop or self.num_tokens <= self.min_tokens:  # no stop string to look for
            self.pending = ""
            return pending
        # Every stop string that could still match starts in `pending`, because anything that
        # might begin one has been held back.
        hit = self._find_stop()
        if hit is not None:
            index, stop = hit
            self.stop_reason = stop
            end = index + len(stop) if self.include_stop else index
        else:
            end = len(pending) if final else len(pending) - self._stop_prefix_len()
        self.pending = pending[end:]
        return pending[:end]

    def _find_stop(self) -> tuple[int, str] | None:
        """(index, stop string) of the earliest stop string in `pending`, if any."""
        match = self.stop_pattern.search(self.pending)
        return None if match is None else (match.start(), match.group())

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the unemitted text that is a proper prefix of a stop
        string (text emitted before min_tokens ran out is never taken back)."""
        pending = self.pending
        if not pending or pending[-1] not in self.stop_prefix_ends:
            return 0
        best = 0
        for s in self.stop:
            tail = pending[max(0, len(pending) - len(s) + 1):]
            i = tail.find(s[0])  # each start of a candidate: only where s's first char is
            while i != -1 and len(tail) - i > best:
                if s.startswith(tail[i:]):
                    best = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return best


def _after(prefix: bytes, data: bytes) -> str:
    """The window rule's new text: what `data` adds to the text of `prefix` (the characters
    past the prefix's own text; less than all of data's where data completes the prefix's last
    character, as decoding the window gives)."""
    if not prefix:
        return data.decode("utf-8", "replace")
    shown = len(prefix.decode("utf-8", "replace"))
    return (prefix + data).decode("utf-8", "replace")[shown:]


def _may_end_inside(data: bytes) -> bool:
    """Whether `data` may end inside a character, so that what follows it decodes differently
    with it than alone (an unfinished character decodes to a final U+FFFD; a final U+FFFD of
    another cause is kept too, which is only slower)."""
    return data.decode("utf-8", "replace").endswith(REPLACEMENT_CHAR)
