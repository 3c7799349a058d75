"""Tiny models that speak a chat family: a Llama of two layers, hidden 64, with the family's
tokenizer and chat template (chat_families.py), trained here on the CPU for a few seconds to
answer each of PROMPTS with the family's ANSWERS: the thinking in the family's reasoning syntax
(where it has a reasoning parser), then a call to get_weather in its tool-call syntax, or a
plain answer.

    model = train_family_model(FAMILIES["qwen3"], tmp_path / "qwen3")
    model.directory          config.json, model.safetensors, generation_config.json,
                             tokenizer files and chat_template.jinja: `loragw serve --model` it
    model.answers["call"]    the Answer it was trained on for PROMPTS["call"]

Training stops once every answer token wins, teacher-forced, by MARGIN nats over the next best
token. Greedy decoding takes the most likely token after each prefix, and teacher forcing scores
exactly the prefixes greedy decoding walks, so the model then writes every trained answer, its
end-of-turn token included, token for token; the margin keeps that true through a server's own
float32 kernels.

Each example is the family's template rendered to text and encoded without special tokens (as
the server encodes a chat prompt), followed by the answer encoded on its own, so the prompt ids
are exactly the ones the server computes for the same request.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from chat_families import Family, render

logger = logging.getLogger(__name__)

# A small tool, so that the long tool preambles of Llama's and Gemma's templates stay near 800
# tokens with the fixtures' small vocabulary (every prompt token costs training time).
FORECAST_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Forecast.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}
ARGUMENTS = {"city": "Paris", "days": 3}
THOUGHT = "The user asks about Paris."
ANSWER = "It is sunny in Paris."
DECLINE = "I will not look it up."


@dataclass(frozen=True)
class Prompt:
    """A request's conversation: its messages, tools and chat_template_kwargs."""

    messages: tuple[dict, ...]
    tools: tuple[dict, ...] = ()
    kwargs: dict = field(default_factory=dict)

    def render(self, tokenizer) -> str:
        return render(tokenizer, list(self.messages), tools=list(self.tools) or None,
                      add_generation_prompt=True, **self.kwargs)


PROMPTS = {
    "call": Prompt(({"role": "system", "content": "You are a weather bot."},
                    {"role": "user", "content": "Weather in Paris?"}), (FORECAST_TOOL,)),
    "plain": Prompt(({"role": "user", "content": "Is it sunny in Paris?"},)),
    # Qwen3 asked not to think: its template writes an empty think block itself
    "quiet": Prompt(({"role": "user", "content": "Is it sunny in Paris?"},),
                    kwargs={"enable_thinking": False}),
}


@dataclass(frozen=True)
class Answer:
    """What a model writes after a prompt (`text`, its end-of-turn token included) and what a
    server that reads the family's syntax returns for it: `reasoning` (None: the response has
    none), `content` (compared without surrounding whitespace; None: nothing but calls), and
    the arguments of each get_weather call, in order."""

    text: str
    reasoning: str | None
    content: str | None
    calls: tuple[dict, ...] = ()


CALL_JSON = json.dumps(ARGUMENTS)
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": ' + CALL_JSON + "}\n</tool_call>"
# Each family's thinking, written before its answer or call (R1's prompt opened <think>).
THINKING = {"qwen3": f"<think>\n{THOUGHT}\n</think>\n\n",
            "magistral": f"[THINK]{THOUGHT}[/THINK]",
            "deepseek_r1_distill_qwen": f"{THOUGHT}\n</think>\n\n"}
# Each family's call, in its tool-call syntax, before its end-of-turn token (Llama 3.1's
# <|python_tag|> call ends with <|eom_id|>: it waits for the tool's output).
CALLS = {
    "llama3_1": '<|python_tag|>{"name": "get_weather", "parameters": ' + CALL_JSON
                + "}<|eom_id|>",
    "llama3_2": '[get_weather(city="Paris", days=3)]',
    "qwen2_5": QWEN_CALL,
    "qwen3": QWEN_CALL,
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "mistral_v0_3": '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + CALL_JSON + "}]",
    "magistral": "[TOOL_CALLS]get_weather[ARGS]" + CALL_JSON,
    "gemma3": '[get_weather(city="Paris", days=3)]',
    "phi4_mini": 'functools[{"name": "get_weather", "arguments": ' + CALL_JSON + "}]",
}


def answers_for(family: Family) -> dict[str, Answer]:
    """The family's answer to each prompt it is trained on (PROMPTS' keys), in its syntax."""
    end, think = family.end_of_turn, THINKING.get(family.name, "")
    thought = THOUGHT if think else None
    answers = {"plain": Answer(think + ANSWER + end, thought, ANSWER)}
    if family.tool_parser is None:  # R1: no parser reads its calls; it declines in words
        answers["call"] = Answer(think + DECLINE + end, thought, DECLINE)
    else:
        call = CALLS[family.name]
        answers["call"] = Answer(think + call + ("" if call.endswith("<|eom_id|>") else end),
                                 thought, None, (ARGUMENTS,))
    if family.name == "qwen3":  # enable_thinking false: the answer alone
        answers["quiet"] = Answer(ANSWER + end, None, ANSWER)
    return answers


# The tokens that end generation, as each family's generation_config.json lists them: Llama's
# <|eom_id|> ends a turn that waits for a tool's output.
STOP_TOKENS = {"llama3_1": ("<|end_of_text|>", "<|eom_id|>"),
               "llama3_2": ("<|end_of_text|>", "<|eom_id|>")}
TINY_LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=2048,
                  rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
MAX_MODEL_LEN = 2048  # the longest prompt (Gemma 3's, tools included) is about 820 tokens
MARGIN = 2.0  # nats every answer token leads the next best by, teacher-forced
LEARNING_RATE = 1e-2
MAX_STEPS = 400


@dataclass(frozen=True)
class FamilyModel:
    family: Family
    directory: Path
    answers: dict[str, Answer]
    steps: int
    seconds: float


@dataclass(frozen=True)
class Example:
    ids: list[int]  # the prompt's ids, then the answer's
    prompt_len: int


def examples(tokenizer, answers: dict[str, Answer]) -> list[Example]:
    out = []
    for key, answer in answers.items():
        prompt = tokenizer.encode(PROMPTS[key].render(tokenizer), add_special_tokens=False)
        out.append(Example(prompt + tokenizer.encode(answer.text, add_special_tokens=False),
                           len(prompt)))
    return out


def train_family_model(family: Family, directory: Path, seed: int = 0) -> FamilyModel:
    """Writes the family's tiny model, trained on its answers, into `directory`."""
    import torch
    import transformers

    started = time.monotonic()
    tokenizer = family.tokenizer(directory)
    answers = answers_for(family)
    data = examples(tokenizer, answers)
    stops = sorted({tokenizer.convert_tokens_to_ids(t)
                    for t in (family.eos, family.end_of_turn, *STOP_TOKENS.get(family.name, ()))})
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=stops,
        dtype="float32", **TINY_LLAMA)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: a second thread only waits on the first
    try:
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
        steps = fit(model, data)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(directory)
    transformers.GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=stops,
                                  do_sample=False).save_pretrained(directory)
    seconds = time.monotonic() - started
    logger.info("%s: trained in %d steps, %.1f s", family.name, steps, seconds)
    return FamilyModel(family, directory, answers, steps, seconds)


def fit(model, data: list[Example], learning_rate: float = LEARNING_RATE,
        max_steps: int = MAX_STEPS) -> int:
    """Adam on the answers' tokens until each leads by MARGIN; the number of steps taken."""
    import torch
    import torch.nn.functional as F

    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trained, lr=learning_rate)
    batches = [(torch.tensor([e.ids]), torch.tensor(e.ids[e.prompt_len:])) for e in data]
    for step in range(max_steps):
        optimizer.zero_grad()
        worst = float("inf")
        for ids, target in batches:
            # ids: [1, T]  target: [A]  logits: [A, V], the positions that predict the answer
            logits = model(ids[:, :-1], logits_to_keep=len(target)).logits[0]
            F.cross_entropy(logits, target).backward()
            worst = min(worst, margin(logits.detach(), target))
        if worst >= MARGIN:
            return step
        optimizer.step()
    raise AssertionError(f"the answers were not learned in {max_steps} steps "
                         f"(worst margin {worst:.2f} < {MARGIN})")


def margin(logits, target) -> float:
    """How far the target token leads the best other one, at the worst position."""
    import torch

    # logits: [A, V]  target: [A]
    chosen = logits.gather(1, target[:, None])[:, 0]
    others = logits.scatter(1, target[:, None], -torch.inf).max(dim=1).values
    return (chosen - others).min().item()


def greedy_answers(model_dir: Path, prompts: list[list[int]], max_new_tokens: int = 80,
                   ) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, up to and with its stop token."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                           do_sample=False)[0, len(ids):].tolist() for ids in prompts]
