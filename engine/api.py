"""Everything the gateway may import from the engine, named once (tools/layout.py holds gateway/
to this module): the options it exposes as flags, the client of a running engine and what
crosses to it and back, the request rules it checks before sending, and the tokenizer's text."""

from loragw.engine.chat import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ReasoningParser,
    ThinkTokens,
    ToolCallDelta,
    ToolCallParser,
    ToolSpec,
    reasoning_parser,
    reasoning_parser_for_template,
    seeded_ids,
    tool_call_parser,
    tool_parser_for_template,
)
from loragw.engine.config import EngineOptions, option
from loragw.engine.core import pin_threads
from loragw.engine.core.client import EngineClient, EngineDied
from loragw.engine.lora.state import LOAD_SECONDS_BUCKETS, LoadTimes
from loragw.engine.request.chat_template import ChatTemplate, TemplateRefused, render_chat
from loragw.engine.request.checks import RequestLimits, check_request
from loragw.engine.request.generation import (
    GenerationDefaults,
    generation_defaults,
    parse_generation_config,
    read_generation_config,
)
from loragw.engine.request.params import InvalidParam, SamplingParams, with_max_tokens
from loragw.engine.request.sequence import EngineRequest, RequestOutput, RequestTimes, TokenLogprob
from loragw.engine.request.structured import GuidedDecoding
from loragw.engine.request.tokenizer import TokenText, encode_chat, tokenize, try_load_tokenizer
from loragw.engine.snapshot import EngineInfo, EngineSnapshot

__all__ = [
    "REASONING_PARSERS", "TOOL_CALL_PARSERS", "ChatTemplate", "GenerationDefaults",
    "ReasoningParser", "TemplateRefused", "ThinkTokens", "ToolCallDelta", "ToolCallParser",
    "ToolSpec", "seeded_ids",
    "generation_defaults", "parse_generation_config", "read_generation_config", "reasoning_parser",
    "reasoning_parser_for_template", "render_chat", "tool_call_parser",
    "tool_parser_for_template",
    "LOAD_SECONDS_BUCKETS", "EngineClient", "EngineDied", "EngineInfo", "EngineOptions",
    "EngineRequest", "EngineSnapshot", "GuidedDecoding", "InvalidParam", "LoadTimes",
    "RequestLimits", "RequestOutput", "RequestTimes", "SamplingParams", "TokenLogprob",
    "TokenText", "check_request", "encode_chat", "option", "pin_threads", "tokenize",
    "try_load_tokenizer", "with_max_tokens",
]
