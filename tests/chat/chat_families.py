"""The chat families the parsers of loragw.engine.chat serve, as local fixtures: each family's chat
template (templates/*.jinja, shaped after the real one; each file's header says how) and a small
tokenizer built here, offline, that carries the family's special and added tokens, each marked
special or not as the family's tokenizer_config.json marks it. So a test renders a conversation
as the family does, and sees which markers a decode with skip_special_tokens drops.

    family = FAMILIES["qwen3"]
    tokenizer = family.tokenizer(tmp_path)     # a byte-level BPE, saved with its template
    text = render(tokenizer, conversation(family), tools=[WEATHER_TOOL])

The `special` flags come from the families' tokenizer_config.json files (Qwen2.5/Qwen3 and the
R1 distills read from stored copies; Llama 3, Mistral, Gemma 3 and Phi-4-mini as their
configurations list them): Qwen's <think>, </think>, <tool_call>, </tool_call> are added tokens
that are NOT special (they survive skip_special_tokens), R1-distill's <｜User｜>/<｜Assistant｜>
likewise; Llama's, Mistral's, Gemma's and Phi's control tokens are special.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"


@dataclass(frozen=True)
class Token:
    content: str
    special: bool


def tokens(special: str = "", plain: str = "") -> tuple[Token, ...]:
    """Tokens from space-separated lists: the special ones, then the added non-special ones."""
    return (tuple(Token(t, True) for t in special.split())
            + tuple(Token(t, False) for t in plain.split()))


@dataclass(frozen=True)
class Family:
    """A chat family: its template file, its tokens, and the vLLM parsers that serve it."""

    name: str
    template: str  # file name under templates/
    tokens: tuple[Token, ...]
    bos: str | None
    eos: str
    end_of_turn: str  # what closes an assistant turn when the template renders one
    reasoning_parser: str | None  # vLLM's --reasoning-parser for the family
    tool_parser: str | None  # vLLM's --tool-call-parser for the family
    call_id: str = "call_0123456789abcdef01234567"  # an id of the family's shape
    # the content of a turn that only calls: None (transformers drops the key), or "" for R1's
    # template, which cannot render a turn without content
    call_content: str | None = None

    @property
    def template_text(self) -> str:
        return (TEMPLATES / self.template).read_text()

    def special(self, content: str) -> bool:
        return next(t.special for t in self.tokens if t.content == content)

    def tokenizer(self, directory: Path):
        """A byte-level BPE trained on CORPUS plus this family's tokens, wrapped in
        PreTrainedTokenizerFast with the template, saved to `directory` and loaded back."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(
            vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False))
        for token in self.tokens:
            added = AddedToken(token.content, special=token.special, normalized=False)
            (bpe.add_special_tokens if token.special else bpe.add_tokens)([added])
        wrapped = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=self.bos,
                                          eos_token=self.eos, clean_up_tokenization_spaces=False)
        wrapped.chat_template = self.template_text
        wrapped.save_pretrained(directory)
        return AutoTokenizer.from_pretrained(directory)


CORPUS = [
    "The weather in Paris is sunny, with a high of 22 degrees.",
    "What is the weather like in Paris for the next three days?",
    "Let me check the forecast for you. I should call the weather tool first.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
    '{"type": "function", "function": {"name": "get_weather", "parameters": {}}}',
    "[get_weather(city='Paris', days=3)] functools tool_call function parameter",
    "You are a helpful assistant. Cutting Knowledge Date: December 2023",
] * 4

LLAMA3 = tokens("<|begin_of_text|> <|end_of_text|> <|start_header_id|> <|end_header_id|> "
                "<|eot_id|> <|eom_id|> <|python_tag|> <|finetune_right_pad_id|>")
QWEN_SPECIAL = "<|endoftext|> <|im_start|> <|im_end|> <|vision_start|> <|vision_end|>"
QWEN2_5 = tokens(QWEN_SPECIAL, "<tool_call> </tool_call> <|fim_prefix|> <|fim_middle|>")
QWEN3 = tokens(QWEN_SPECIAL, "<tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> "
               "<tool_response> </tool_response> <think> </think>")
MISTRAL_V0_3 = tokens("<unk> <s> </s> [INST] [/INST] [TOOL_CALLS] [AVAILABLE_TOOLS] "
                      "[/AVAILABLE_TOOLS] [TOOL_RESULTS] [/TOOL_RESULTS]")
MAGISTRAL = tokens("<unk> <s> </s> [INST] [/INST] [AVAILABLE_TOOLS] [/AVAILABLE_TOOLS] "
                   "[TOOL_RESULTS] [/TOOL_RESULTS] [TOOL_CALLS] [SYSTEM_PROMPT] "
                   "[/SYSTEM_PROMPT] [ARGS] [CALL_ID] [THINK] [/THINK]")
R1_DISTILL = tokens("<｜end▁of▁sentence｜> <｜begin▁of▁sentence｜>",
                    "<｜User｜> <｜Assistant｜> <|EOT|> <think> </think> <tool_call> </tool_call>")
GEMMA3 = tokens("<pad> <eos> <bos> <start_of_turn> <end_of_turn> <start_of_image>")
PHI4_MINI = tokens("<|endoftext|> <|system|> <|user|> <|assistant|> <|end|> <|tool|> <|/tool|> "
                   "<|tool_call|> <|/tool_call|> <|tool_response|>")

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama3_1", "llama3_1.jinja", LLAMA3, "<|begin_of_text|>", "<|eot_id|>",
           "<|eot_id|>", None, "llama3_json"),
    Family("llama3_2", "llama3_2_pythonic.jinja", LLAMA3, "<|begin_of_text|>", "<|eot_id|>",
           "<|eot_id|>", None, "pythonic"),
    Family("qwen2_5", "qwen2_5.jinja", QWEN2_5, None, "<|im_end|>", "<|im_end|>", None,
           "hermes"),
    Family("qwen3", "qwen3.jinja", QWEN3, None, "<|im_end|>", "<|im_end|>", "qwen3", "hermes"),
    Family("qwen3_coder", "qwen3_coder.jinja", QWEN3, None, "<|im_end|>", "<|im_end|>", None,
           "qwen3_coder"),
    Family("mistral_v0_3", "mistral_v0_3.jinja", MISTRAL_V0_3, "<s>", "</s>", "</s>", None,
           "mistral", call_id="abcDEF123"),
    Family("magistral", "magistral.jinja", MAGISTRAL, "<s>", "</s>", "</s>", "mistral",
           "mistral", call_id="abcDEF123"),
    # vLLM serves R1's tool calls with deepseek_v3 and a template of its own: not one of ours
    Family("deepseek_r1_distill_qwen", "deepseek_r1_distill_qwen.jinja", R1_DISTILL,
           "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
           "deepseek_r1", None, call_content=""),
    Family("gemma3", "gemma3.jinja", GEMMA3, "<bos>", "<eos>", "<end_of_turn>", None,
           "pythonic"),
    Family("phi4_mini", "phi4_mini.jinja", PHI4_MINI, "<|endoftext|>", "<|endoftext|>",
           "<|end|>", None, "phi4_mini_json"),
)}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast for a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city's name."},
        "days": {"type": "integer", "description": "How many days ahead."},
        "metric": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "integer"}}}}}}
CALL_ARGUMENTS = {"city": "Paris", "days": 3}
RESULT = '{"forecast": "sunny", "high": 22}'


def conversation(family: Family, arguments: object = None, reasoning: str | None = None,
                 ) -> list[dict]:
    """system, user, assistant calling get_weather (with `reasoning` if given), the tool's
    result, the assistant's answer, and a second user question."""
    call = {"id": family.call_id, "type": "function", "function": {
        "name": "get_weather", "arguments": CALL_ARGUMENTS if arguments is None else arguments}}
    calling: dict = {"role": "assistant", "content": family.call_content, "tool_calls": [call]}
    if reasoning is not None:
        calling["reasoning_content"] = reasoning
    return [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
        calling,
        {"role": "tool", "tool_call_id": family.call_id, "name": "get_weather", "content": RESULT},
        {"role": "assistant", "content": "Sunny, 22 degrees."},
        {"role": "user", "content": "And tomorrow?"},
    ]


def render(tokenizer, messages: list[dict], **kwargs) -> str:
    """The template's text for `messages` (kwargs: tools, add_generation_prompt, template
    variables such as enable_thinking)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
