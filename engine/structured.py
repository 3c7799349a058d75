"""Structured output: per-request grammars that mask logits so the output always parses.

A request's `SamplingParams.guided` (a `GuidedDecoding`) is compiled once per distinct spec by
xgrammar (LRU-cached), and each request gets its own matcher (`GuidedState`). Every step:

    mask = matcher.fill_next_token_bitmask()      one packed int32 bitmask row per constrained row
    logits[row][~mask] = -inf                      only on constrained rows, before sampling
    matcher.accept_token(sampled)                  after sampling

Stop tokens (EOS) are allowed only where the grammar may end; the request ends when the matcher
accepts one. JSON is compact (no free whitespace), so the EOS is forced right after the last
brace. Rows without a grammar are never touched.
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import xgrammar as xgr
from torch import Tensor

logger = logging.getLogger(__name__)

GuidedKind = Literal["json_object", "json_schema", "regex", "choice"]
GRAMMAR_CACHE_SIZE = 256  # distinct compiled specs kept per engine


@dataclass(frozen=True)
class GuidedDecoding:
    """What the output must match. spec: None (json_object), a JSON schema (dict or str),
    a regex (str), or a list of allowed strings (choice)."""

    kind: GuidedKind
    spec: Any = None

    def __post_init__(self) -> None:
        checks = {
            "json_object": self.spec is None,
            "json_schema": isinstance(self.spec, dict | str | bool),
            "regex": isinstance(self.spec, str) and self.spec != "",
            "choice": (isinstance(self.spec, list | tuple) and len(self.spec) > 0
                       and all(isinstance(c, str) and c for c in self.spec)),
        }
        if self.kind not in checks:
            raise ValueError(f"guided decoding kind must be one of {sorted(checks)}, "
                             f"got {self.kind!r}")
        if not checks[self.kind]:
            raise ValueError(f"guided {self.kind} needs " + {
                "json_object": "no spec", "json_schema": "a JSON schema object",
                "regex": "a non-empty regex string",
                "choice": "a non-empty list of non-empty strings"}[self.kind])

    def key(self) -> tuple[str, str]:
        """(kind, canonical spec): equal specs share one compiled grammar."""
        spec = self.spec
        if self.kind == "json_schema" and isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from None
        return self.kind, json.dumps(spec, sort_keys=True)


@dataclass(slots=True, eq=False)
class GuidedState:
    """One request's grammar matcher (engine-owned; created by add_request)."""

    matcher: xgr.GrammarMatcher

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            # The mask made this impossible; if it happens, the grammar and mask disagree.
            logger.warning("grammar rejected token %d that its own mask allowed", token)

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()


@dataclass(slots=True)
class TokenMask:
    """Packed allowed-token bitmasks for some rows of a sampling batch.

    bitmask: [R, ceil(V / 32)] int32, row j for logits row rows[j]."""

    bitmask: Tensor
    rows: list[int]

    def apply(self, logits: Tensor) -> Tensor:
        """logits: [B, V] fp32 -> a copy with disallowed tokens of the masked rows at -inf."""
        logits = logits.clone()
        sub = logits[self.rows].cpu()  # [R, V]; xgrammar's CPU kernel
        xgr.apply_token_bitmask_inplace(sub, self.bitmask)
        logits[self.rows] = sub.to(logits.device)
        return logits


class GrammarCompiler:
    """xgrammar over one tokenizer and the model's vocab (which may exceed the tokenizer's)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

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
        return GuidedState(xgr.GrammarMatcher(self.compile(guided)))

    def fill(self, states: list[tuple[int, GuidedState]]) -> TokenMask | None:
        """Bitmasks of the (row, state) pairs; None if there are none."""
        if not states:
            return None
        bitmask = xgr.allocate_token_bitmask(len(states), self.vocab_size)  # [R, W] int32
        for j, (_, state) in enumerate(states):
            state.matcher.fill_next_token_bitmask(bitmask, j)
        return TokenMask(bitmask, [row for row, _ in states])

    def fill_async(self, states: list[tuple[int, GuidedState]]) -> Future | None:
        """fill() on the mask thread, so it overlaps the forward pass; None if nothing to do."""
        return self._pool.submit(self.fill, states) if states else None


def _ebnf_string(text: str) -> str:
    # JSON string escapes (\" \\ \n \uXXXX) are valid EBNF string-literal escapes in xgrammar.
    return json.dumps(text, ensure_ascii=False)


def tool_call_schema(tools: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """JSON schema of one call {"name": n, "arguments": <n's parameters>} of the allowed tools."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    calls = []
    for name in names:
        params = by_name[name].get("parameters") or {"type": "object", "properties": {}}
        calls.append({"type": "object", "properties": {"name": {"const": name},
                                                       "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False})
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def parse_tool_call(text: str, names: list[str]) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) if `text` is one call {"name", "arguments"} of an
    allowed tool, optionally inside <tool_call></tool_call> (the demo and Qwen templates' tags)."""
    body = text.strip()
    if body.startswith("<tool_call>") and body.endswith("</tool_call>"):
        body = body[len("<tool_call>"):-len("</tool_call>")].strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not (isinstance(call, dict) and call.get("name") in names
            and isinstance(call.get("arguments"), dict)):
        return None
    return call["name"], json.dumps(call["arguments"], ensure_ascii=False)


__all__ = ["GrammarCompiler", "GuidedDecoding", "GuidedState", "TokenMask", "parse_tool_call",
           "tool_call_schema"]
