"""Structured output: per-request grammars that mask logits so the output always parses.

A request's `SamplingParams.guided` (a `GuidedDecoding`) is compiled once per distinct spec by
xgrammar (LRU-cached), and each request gets its own matcher (`GuidedState`). Every step:

    mask thread, while the forward pass runs:
        matcher.accept_token(last step's kept tokens)      each constrained row
        matcher.fill_next_token_bitmask(...)               [R, ceil(V / 32)] packed int32
        bias = 0 / -inf per token, unpacked from the bitmask
    main thread, after the forward pass:
        logits[rows] += bias                               only constrained rows, before sampling

Accepting a token is deferred to the next step's mask job, so the main thread never touches a
matcher. That is safe because the mask only ever allows tokens the grammar accepts, and a
grammar terminates exactly when it accepts a stop token: "finished" is known from the sampled
token alone. Stop tokens (EOS) are allowed only where the grammar may end. JSON is compact (no
free whitespace), so the EOS is forced right after the last brace. Unconstrained rows are never
touched.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

try:
    import xgrammar as xgr
except ImportError:  # only structured output needs it: the engine serves everything else
    xgr = None

from loragw.engine.request.token_mask import TokenMask, mask_bias, pack_bitmask

logger = logging.getLogger(__name__)

GuidedKind = Literal["json_object", "json_schema", "regex", "choice", "syntax"]
GRAMMAR_CACHE_SIZE = 256  # distinct compiled specs kept per engine


@dataclass(frozen=True)
class GuidedDecoding:
    """What the output must match. spec: None (json_object), a JSON schema (dict or str),
    a regex (str), a list of allowed strings (choice), or alternatives of parts in a row
    (syntax: [[["text", "<tool_call>\\n"], ["json_schema", {...}], ["text", "</tool_call>"]],
    ...], a parts' kind one of text, json_schema, regex: a family's tool-call syntax).
    `after`: the tokens that end a
    model's thinking (the served model's reasoning parser's end marker): the output is
    constrained from the token after one of them on, its thinking before that is free; ():
    from the first token."""

    kind: GuidedKind
    spec: Any = None
    after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        checks = {
            "json_object": self.spec is None,
            "json_schema": isinstance(self.spec, dict | str | bool),
            "regex": isinstance(self.spec, str) and self.spec != "",
            "choice": (isinstance(self.spec, list | tuple) and len(self.spec) > 0
                       and all(isinstance(c, str) and c for c in self.spec)),
            "syntax": (isinstance(self.spec, list | tuple) and len(self.spec) > 0
                       and all(isinstance(a, list | tuple) and a and all(
                           isinstance(p, list | tuple) and len(p) == 2
                           and p[0] in ("text", "json_schema", "regex") for p in a)
                           for a in self.spec)),
        }
        if self.kind not in checks:
            raise ValueError(f"guided decoding kind must be one of {sorted(checks)}, "
                             f"got {self.kind!r}")
        if not checks[self.kind]:
            raise ValueError(f"guided {self.kind} needs " + {
                "json_object": "no spec", "json_schema": "a JSON schema object",
                "regex": "a non-empty regex string",
                "choice": "a non-empty list of non-empty strings",
                "syntax": "alternatives of [kind, value] parts"}[self.kind])

    def key(self) -> tuple[str, str]:
        """(kind, spec as JSON): equal specs share one compiled grammar. Key order is kept, not
        sorted: a schema's property order is the order the output writes its keys in."""
        spec = self.spec
        if self.kind == "json_schema" and isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from None
        return self.kind, json.dumps(spec)


@dataclass(slots=True, eq=False)
class GuidedState:
    """One request's grammar matcher (engine-owned; created by add_request).

    The engine calls `advance(token)` for each token a step kept (one, or with speculative
    decoding the accepted drafts and one more); the matcher itself accepts them on the mask
    thread at the start of the next mask job (`GrammarCompiler.fill`)."""

    matcher: xgr.GrammarMatcher
    stop_token_ids: frozenset[int]
    json: bool = False  # the output is JSON (json_object / json_schema)
    pending: list[int] = field(default_factory=list)  # kept, not yet accepted by the matcher
    done: bool = False  # a stop token was sampled: the grammar is complete
    # the end-of-thinking tokens the grammar waits for (GuidedDecoding.after); empty once one
    # was kept: from the next token on the output is constrained
    waiting: frozenset[int] = frozenset()

    def advance(self, token: int) -> None:
        if self.waiting:
            if token in self.waiting:
                self.waiting = frozenset()
            return
        self.pending.append(token)
        self.done = token in self.stop_token_ids

    def constrained_from(self, drafts: list[int]) -> int | None:
        """The index among this step's rows (the next token, then after each draft) from which
        the grammar constrains them: 0 unless it waits; after the draft that ends the thinking;
        None when it waits beyond them all."""
        if not self.waiting:
            return 0
        return next((i + 1 for i, t in enumerate(drafts) if t in self.waiting), None)


class GrammarCompiler:
    """xgrammar over one tokenizer and the model's vocab (which may exceed the tokenizer's)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        if xgr is None:
            raise ValueError("structured output needs the xgrammar package, which is not "
                             "installed here (pip install xgrammar)")
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.stop_token_ids = frozenset(stop_token_ids)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        # Compact JSON never holds a raw byte below 0x20 (RFC 8259 wants them escaped inside
        # strings), but xgrammar 0.2.9's string rule lets such tokens through: JSON rows are
        # also ANDed with this mask of tokens free of control bytes.
        self._no_control_bytes = pack_bitmask(
            [all(b >= 0x20 for b in token) for token in info.decoded_vocab], vocab_size)

    def compile(self, guided: GuidedDecoding) -> xgr.CompiledGrammar:
        """Raises ValueError naming the problem for an invalid schema, regex or choice."""
        key = guided.key()
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        kind, spec = key
        try:
            if kind == "json_object":  # any object, compact
                grammar = self._compiler.compile_json_schema('{"type": "object"}',
                                                             any_whitespace=False)
            elif kind == "json_schema":
                grammar = self._compiler.compile_json_schema(spec, any_whitespace=False)
            elif kind == "regex":
                grammar = self._compiler.compile_regex(json.loads(spec))
            elif kind == "syntax":
                grammar = self._compiler.compile_grammar(syntax_grammar(json.loads(spec)))
            else:
                choices = " | ".join(_ebnf_string(c) for c in json.loads(spec))
                grammar = self._compiler.compile_grammar(f"root ::= {choices}")
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its reason
            what = {"json_schema": "JSON schema", "regex": "regex"}.get(kind, kind)
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", reason)  # xgrammar's log prefix
            raise ValueError(f"invalid {what}: {reason}") from None
        self._cache[key] = grammar
        if len(self._cache) > GRAMMAR_CACHE_SIZE:
            self._cache.popitem(last=False)
        return grammar

    def new_state(self, guided: GuidedDecoding) -> GuidedState:
        return GuidedState(xgr.GrammarMatcher(self.compile(guided)), self.stop_token_ids,
                           json=json_output(guided), waiting=frozenset(guided.after))

    def fill(self, states: list[tuple[int, GuidedState, list[int]]]) -> TokenMask | None:
        """Accept each state's pending tokens, then fill the bitmasks of the (first row, state,
        drafts) triples; None if there are none. A state with drafts (speculative decoding)
        fills len(drafts) + 1 rows from `first` on: row i as if drafts[:i] were accepted (the
        matcher accepts them, then rolls them back); rows past a draft the grammar refuses
        repeat the last mask (that draft is rejected there, so they are never used). (Plain
        loops: xgrammar's batch calls cost more in their Python wrappers than they save, at
        these batch sizes.)"""
        if not states:
            return None
        rows = [first + i for first, _, drafts in states for i in range(len(drafts) + 1)]
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)  # [R, W] int32
        words = bitmask.numpy()  # the same memory
        json_rows, j = [], 0
        for _, state, drafts in states:
            for token in state.pending:
                if not state.matcher.accept_token(token):
                    # The mask made this impossible: the grammar and mask disagree.
                    logger.warning("grammar rejected token %d that its own mask allowed", token)
            state.pending = []
            accepted = 0
            for i in range(len(drafts) + 1):
                if i == accepted and not (i and state.matcher.is_terminated()):
                    state.matcher.fill_next_token_bitmask(bitmask, j + i)
                    if i < len(drafts) and state.matcher.accept_token(drafts[i]):
                        accepted += 1
                else:
                    words[j + i] = words[j + i - 1]
            if accepted:
                state.matcher.rollback(accepted)
            if state.json:
                json_rows.extend(range(j, j + len(drafts) + 1))
            j += len(drafts) + 1
        if json_rows:
            words[json_rows] &= self._no_control_bytes
        bias = torch.from_numpy(mask_bias(words, self.vocab_size))
        return TokenMask(bitmask, rows, bias)

    def fill_async(self, states: list[tuple[int, GuidedState, list[int]]]) -> Future | None:
        """fill() on the mask thread, so it overlaps the forward pass; None if nothing to do."""
        return self._pool.submit(self.fill, states) if states else None


def json_output(guided: GuidedDecoding) -> bool:
    """Whether no token of the output holds a control byte: JSON (which escapes them), or a
    syntax of JSON and text parts free of them (no regex part)."""
    if guided.kind != "syntax":
        return guided.kind in ("json_object", "json_schema")
    return all(kind == "json_schema" or (kind == "text" and value.isprintable())
               for alt in guided.spec for kind, value in alt)


def syntax_grammar(alternatives: list) -> xgr.Grammar:
    """The grammar of a "syntax" spec: its alternatives' parts in a row, either alternative."""
    def part(kind: str, value) -> xgr.Grammar:
        if kind == "text":
            return xgr.Grammar.from_ebnf(f"root ::= {_ebnf_string(value)}")
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        return xgr.Grammar.from_json_schema(json.dumps(value), any_whitespace=False)

    rows = [xgr.Grammar.concat(*(part(*p) for p in alt)) for alt in alternatives]
    return rows[0] if len(rows) == 1 else xgr.Grammar.union(*rows)


def _ebnf_string(text: str) -> str:
    # JSON string escapes (\" \\ \n \uXXXX) are valid EBNF string-literal escapes in xgrammar.
    return json.dumps(text, ensure_ascii=False)


__all__ = ["GrammarCompiler", "GuidedDecoding", "GuidedState", "TokenMask"]
