"""Chat as each model family speaks it: the reasoning a model writes apart from its answer, and
its tool calls, read from its output text in the family's own syntax (vLLM's parser names).

    reasoning_parser("qwen3")()          a ReasoningParser: split(text), stream(), token predicates
    tool_call_parser("hermes")()         a ToolCallParser: parse(text, ids), stream(ids)
    tool_parser_for_template(template)   which tool-call parser a chat template's markers ask for
    reasoning_parser_for_template(t)     which reasoning parser, likewise

Every parser reads text decoded WITH the special tokens kept (`skip_special_tokens=False`, or at
least the markers kept): `<think>`, `[THINK]`, `[TOOL_CALLS]` and `<|python_tag|>` are special
tokens in some families, and a decode that skips them leaves nothing to find. Each parser gives
the same result whether it reads the whole text at once or in pieces of any size.
"""

from loragw.engine.chat.reasoning import (
    Phase,
    ReasoningDelta,
    ReasoningParser,
    ReasoningSplit,
    ReasoningStream,
    ThinkTagParser,
    ThinkTokens,
)
from loragw.engine.chat.registry import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    reasoning_parser,
    reasoning_parser_for_template,
    tool_call_parser,
    tool_parser_for_template,
)
from loragw.engine.chat.tool_calls import (
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolCallStream,
    ToolParseResult,
    ToolSpec,
    ToolStreamDelta,
    mistral_call_id,
    openai_call_id,
    seeded_ids,
)

__all__ = [
    "REASONING_PARSERS", "TOOL_CALL_PARSERS", "Phase", "ReasoningDelta", "ReasoningParser",
    "ReasoningSplit", "ReasoningStream", "ThinkTagParser", "ThinkTokens", "ToolCall",
    "ToolCallDelta", "ToolCallParser", "ToolCallStream", "ToolParseResult", "ToolSpec",
    "ToolStreamDelta", "mistral_call_id", "openai_call_id", "reasoning_parser",
    "reasoning_parser_for_template", "seeded_ids", "tool_call_parser",
    "tool_parser_for_template",
]
