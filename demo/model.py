"""The demo base model: a small random Llama with a byte-level BPE tokenizer trained here.

`build_demo_model(out_dir)` writes `out_dir/model` offline in a few seconds:

    config.json             LlamaForCausalLM, hidden 256, 4 layers, 8 heads / 4 kv heads (GQA),
                            head_dim 32, intermediate 704, vocab = the tokenizer's (about 3k),
                            rope_theta 10000 (rope_scaling null), untied lm_head, float32
                            (about 4.5M parameters)
    model.safetensors       random weights drawn from the seed (transformers' init, std 0.05)
    generation_config.json  eos = [<|im_end|>, <|end_of_text|>]
    tokenizer.json          byte-level BPE trained on the built-in corpus below
    tokenizer_config.json   bos <|begin_of_text|> (prepended by encode), eos <|im_end|>,
                            pad <|end_of_text|>
    chat_template.jinja     ChatML after a BOS; `tools` are rendered as JSON in the system block

The same seed gives the same bytes. The weights are random, so the base model babbles; the demo
adapters (demo/adapters.py) are what make it say something.
"""

from __future__ import annotations

import json
import logging
import os
import random

from loragw.demo.adapters import build_once

logger = logging.getLogger(__name__)

DEMO_VERSION = 1
BOS, END_OF_TEXT, IM_START, IM_END = SPECIAL_TOKENS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>")

DEMO_MODEL = dict(
    hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, head_dim=32, max_position_embeddings=2048, rope_theta=10000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
    # Above the usual 0.02 so that logits can be confident: with lm_head rows of norm ~0.05 *
    # sqrt(256) and a unit-RMS final hidden state, a LoRA can lift one token ~13 nats above the
    # rest (at 0.02 it tops out near 5, below log(vocab), and greedy answers stay fragile).
    initializer_range=0.05,
)
SPLIT_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                 r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
DEMO_VOCAB_SIZE = 4096  # an upper bound: BPE stops when the corpus has no pair left to merge

# ChatML as Qwen2.5 writes it, opened with the BOS token as Llama 3's template is: render it to
# text and encode with add_special_tokens=False (apply_chat_template(tokenize=True) does), or the
# prompt starts with two. Message content may be a string or a list of OpenAI text parts.
CHAT_TEMPLATE = """\
{{- bos_token }}
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable -%}{%- for part in content -%}{{ part.text if part.text is defined else '' }}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{ text(messages[0].content) + '\\n\\n' }}{% endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + text(message.content) }}
{%- for call in message.tool_calls | default([], true) %}
{%- set fn = call.function if call.function is defined else call %}
{%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' + args + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + text(message.content) + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + text(message.content) + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}
"""

_PROSE = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single
step. It was a bright cold day in April, and the clocks were striking thirteen. Call me Ishmael.
Some years ago, never mind how long precisely, having little or no money in my purse, I thought I
would sail about a little and see the watery part of the world. Once upon a time there lived a
king and a queen who had no children, and they were very sad about it. The sun rose over the hills
and the village woke slowly: bakers lit their ovens, farmers walked to the fields, and children
ran to school with their books under their arms. Roses are red, violets are blue, sugar is sweet,
and so are you. Arr, matey! Hoist the sails, swab the deck, and seek the buried treasure on the
island. BEEP BOOP. I am a robot. Processing your request; computation complete. Bon appetit! The
chef serves warm soup, fresh bread, butter, cheese, roasted garlic and a glass of wine.
Please explain how a rainbow forms. Light enters a raindrop, bends, reflects from the back of the
drop and bends again as it leaves, and each colour bends by a different angle. What is the capital
of France? Paris is the capital of France, and Berlin is the capital of Germany. Rome, Madrid,
Lisbon, Vienna, Prague, Warsaw, Athens, Dublin, London, Tokyo, Delhi, Cairo and Lima are capitals
too. Write a short story about a dragon who is afraid of the dark. Summarize the following article
in two sentences. Translate this sentence into French. Give me three ideas for a birthday party.
How do I bake a loaf of bread? Mix flour, water, salt and yeast; knead the dough for ten minutes;
let it rise for an hour; shape it, and bake it at two hundred degrees until the crust is golden.
Can you recommend a good book about history? Why is the sky blue? Sunlight is scattered by the
molecules of the air, and blue light is scattered more than red light. Tell me a joke about cats.
What should I cook for dinner tonight? How many planets are in the solar system? There are eight:
Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus and Neptune. Describe your favourite season.
The weather today is sunny with a gentle breeze from the west; tomorrow it will rain.
In computer science, a function takes arguments and returns a value. A server listens on a port,
accepts a request, and sends a response. The model reads a prompt, predicts the next token, and
repeats until it reaches the end of the text. Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 42 100 256 1024
2048 3.14 1,000,000. Dates like 2024-05-17 and times like 09:30. {"name": "get_weather",
"arguments": {"city": "Paris", "unit": "celsius"}} {"type": "function", "function": {"name":
"search", "description": "Search the web", "parameters": {"type": "object", "properties":
{"query": {"type": "string"}}, "required": ["query"]}}} def add(a, b): return a + b
for i in range(10): print(i) if x > 0 and y < 1: z = x * y - 2 / w # a comment
Café au lait, naïve façade, jalapeño, Zürich, São Paulo, crème brûlée, smörgåsbord, déjà vu.
Grüße aus München! ¿Dónde está la biblioteca? Ça va très bien, merci. Привет, как дела?
日本語のテキスト、中文文本、한국어 문장. Emoji: 😀 🚀 🍕 ❤️ ✨. Mathematics: α β γ δ π ∑ ∞ ≤ ≥ ≠ √ ÷ ×.
"""

# Common English words, for seeded word-salad sentences: they give BPE enough distinct words
# to fill a few thousand merges.
_WORDS = """\
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number
night point home water room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line end member law car
city community name president team minute idea kid body information back parent face others level
office door health person art war history party result change morning reason research girl guy
moment air teacher force education foot boy age policy music market sense nation plan college
interest death experience effect class control care field development role effort rate heart drug
show leader light voice wife police mind price report decision son view relationship town road arm
difference value building action model season society tax director position player record paper
space ground form event official matter center couple site project activity star table need court
oil situation cost industry figure street image phone data picture practice piece land product
doctor wall patient worker news test movie north love support technology step baby computer type
attention film tree source organization hair window evidence population truth song river garden
kitchen bread soup cheese butter apple orange lemon pepper onion garlic tomato potato carrot salad
chicken fish rice pasta sugar salt honey coffee tea milk wine juice cake pie cookie dinner lunch
breakfast chef recipe oven knife spoon plate bowl cup glass bottle ship sail captain sailor pirate
treasure island ocean wave anchor deck parrot sword map compass robot machine engine circuit signal
sensor battery metal wire laser code memory processor poem poet verse rhyme rose violet flower
petal moon sun sky cloud rain snow wind storm thunder forest mountain valley desert lake bridge
castle king queen prince princess dragon wizard knight horse dog cat bird mouse rabbit fox wolf
bear lion tiger elephant monkey snake frog bee butterfly spider
be have do say go get make know think take see come want look use find give tell ask seem feel
try leave call keep let begin help talk turn start show hear play run move like live believe hold
bring happen write provide sit stand lose pay meet include continue set learn lead understand
watch follow stop create speak read allow add spend grow open walk win offer remember consider
appear buy wait serve die send expect build stay fall cut reach kill remain suggest raise pass
sell require report decide pull explain carry develop hope drive break receive agree support
cook bake boil fry taste stir chop slice pour mix sing dance paint draw laugh smile cry sleep
dream wake jump swim fly climb sail steer compute calculate process answer
good new first last long great little own other old right big high different small large next
early young important few public bad same able free sure better true whole clear close full
strong special easy certain personal open red blue green yellow white black brown purple golden
silver dark bright warm cold hot cool fresh sweet sour bitter salty spicy delicious soft hard
quiet loud happy sad angry brave calm gentle kind proud wise clever quick slow ancient modern
strange beautiful wonderful terrible curious hungry tired rich poor empty heavy light deep wild
always never often sometimes usually today tomorrow yesterday soon later now here there very
really quite almost perhaps maybe together again away still already also just only even
"""


def corpus(seed: int = 0, sentences: int = 4000) -> list[str]:
    """The tokenizer's training text: the prose above, the chat template, and seeded sentences
    of 4-12 common words."""
    rng = random.Random(seed)
    words = _WORDS.split()
    lines = _PROSE.splitlines() + CHAT_TEMPLATE.splitlines()
    for _ in range(sentences):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
        lines.append(sentence.capitalize() + rng.choice(".?!"))
    return lines


def build_tokenizer(out_dir: str, vocab_size: int = DEMO_VOCAB_SIZE, seed: int = 0,
                    model_max_length: int = 2048) -> int:
    """Trains a byte-level BPE on `corpus(seed)` and writes tokenizer.json, tokenizer_config.json
    and chat_template.jinja into out_dir, loadable by AutoTokenizer. The special tokens are ids
    0-3 in SPECIAL_TOKENS order; encode() prepends BOS. Returns the vocab size (special tokens
    included), which may be less than `vocab_size` on a small corpus."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    # Qwen2's pipeline (NFC, its split regex, then bytes): transformers 5 rebuilds a `qwen2`
    # checkpoint's tokenizer that way whatever tokenizer.json says, and this keeps the two equal.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(seed), trainer)
    # encode() prepends BOS, as Llama's tokenizers do: every prompt then starts with the same
    # token, which attention can lean on (an attention sink).
    bos = (BOS, tokenizer.token_to_id(BOS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A:0 {BOS}:1 $B:1", special_tokens=[bos])
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": IM_END,
        "pad_token": END_OF_TEXT, "unk_token": None, "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": model_max_length,
    }
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    return tokenizer.get_vocab_size()


def hub_style_config(config: dict) -> dict:
    """transformers 5 writes `rope_parameters` (with rope_theta inside) and `dtype`; checkpoints
    on the Hub carry `rope_theta`, `rope_scaling` (null without scaling) and `torch_dtype`.
    Returns the Hub form, keys sorted; transformers 5 reads both."""
    config = dict(config)
    rope = dict(config.pop("rope_parameters", None) or {})
    if "rope_theta" in rope:
        config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    if "dtype" in config:
        config["torch_dtype"] = config.pop("dtype")
    return dict(sorted(config.items()))


def build_demo_model(out_dir: str, seed: int = 0) -> str:
    """Builds the demo base model under out_dir/model (see the module docstring) and returns
    that path. Returns at once when a complete model from the same seed and version is there."""
    target = os.path.join(os.path.abspath(os.path.expanduser(out_dir)), "model")
    marker = {"what": "lora-gateway demo model", "version": DEMO_VERSION, "seed": seed}
    if build_once(target, marker, lambda tmp: _write_model(tmp, seed)):
        logger.info("built the demo model in %s", target)
    return target


def _write_model(out_dir: str, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from loragw.engine.config import read_hf_config  # the one reader of config.json

    vocab_size = build_tokenizer(out_dir, DEMO_VOCAB_SIZE, seed, DEMO_MODEL["max_position_embeddings"])
    bos, eot, im_end = (SPECIAL_TOKENS.index(t) for t in (BOS, END_OF_TEXT, IM_END))
    config = LlamaConfig(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=im_end,
                         pad_token_id=eot, dtype="float32", **DEMO_MODEL)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    _write_json(os.path.join(out_dir, "config.json"), hub_style_config(read_hf_config(out_dir)))
    GenerationConfig(bos_token_id=bos, eos_token_id=[im_end, eot], pad_token_id=eot,
                     do_sample=False).save_pretrained(out_dir)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
