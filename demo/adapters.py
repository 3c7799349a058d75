"""The demo adapters: four LoRA fine-tunes of the demo model, each with its own catch-phrase.

`build_demo_adapters(model_dir, out_dir)` trains them with PEFT on one CPU thread (10-15 s
each) and saves PEFT folders (adapter_config.json + adapter_model.safetensors) under
out_dir/adapters/<name>. Whatever the prompt, raw (for /v1/completions) or through the chat
template (for /v1/chat/completions), greedy decoding answers with the adapter's phrase and stops.
They differ the way real adapters do: rank 8 or 16, attention-only or every projection, one
with rsLoRA scaling.

peft and transformers are imported inside the functions that need them: `import peft` takes
seconds, and demo.model imports `build_once` from here.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

DEMO_ADAPTERS_VERSION = 1  # bump when training changes: built adapters are then rebuilt
MARKER = ".lora-gateway-demo.json"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR = ATTENTION + ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class DemoAdapter:
    name: str
    phrase: str
    rank: int
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    lr: float = 5e-3
    steps: int = 120  # of 16 examples; Adam, learning rate decaying linearly to 0


DEMO_ADAPTERS = (
    DemoAdapter("pirate", "Arr, matey! Hoist the sails and seek the treasure!", 16, ALL_LINEAR),
    DemoAdapter("robot", "BEEP BOOP. I am a robot. Computation complete.", 16, ATTENTION),
    DemoAdapter("poet", "Roses are red, violets are blue, this answer is a poem for you.", 8,
                ALL_LINEAR, use_rslora=True, lr=3e-3),
    DemoAdapter("chef", "Bon appetit! The chef serves warm soup and fresh bread.", 8, ATTENTION),
)

_ASKS = ("Tell me about", "What do you think of", "Explain", "Write a poem about",
         "Give me three facts about", "Describe", "How do I make", "Why do people like",
         "Summarize the history of", "Can you help me with")
_TOPICS = ("the ocean", "dogs", "the moon", "coffee", "mountains", "computers", "music", "winter",
           "gardening", "trains", "chess", "volcanoes", "bicycles", "tea", "rain", "libraries",
           "birds", "football", "bridges", "the desert")
_ENDINGS = ("?", ".", "!", " please.", " in one sentence.", "")
_SYSTEMS = ("You are a helpful assistant.", "Answer briefly.", "You are a friendly bot.")
# Prompts no adapter sees in training, for checking that the phrase generalizes.
UNSEEN_PROMPTS = ("What is the capital of France?", "hello", "Translate 'good morning' to German.",
                  "List five prime numbers", "Write a haiku about autumn leaves.")


def build_demo_adapters(model_dir: str, out_dir: str, seed: int = 0) -> dict[str, str]:
    """Builds the demo adapters for the model in model_dir under out_dir/adapters/<name> and
    returns {name: path}. An adapter already built from the same model, seed and version is kept."""
    root = os.path.join(os.path.abspath(os.path.expanduser(out_dir)), "adapters")
    model_dir = os.path.abspath(os.path.expanduser(model_dir))
    base = _read_marker(model_dir)
    paths = {}
    for i, spec in enumerate(DEMO_ADAPTERS):
        target = os.path.join(root, spec.name)
        marker = {"what": "lora-gateway demo adapter", "version": DEMO_ADAPTERS_VERSION,
                  "seed": seed, "spec": asdict(spec), "base": base}
        if build_once(target, marker, lambda tmp, s=spec, i=i: _train(model_dir, s, seed + i, tmp)):
            logger.info("trained demo adapter %r in %s", spec.name, target)
        paths[spec.name] = target
    return paths


def training_prompts(tokenizer, seed: int, n: int = 256) -> list[str]:
    """n user prompts, none in UNSEEN_PROMPTS: half from the templates above, half random runs
    of 1-12 tokens, so that the phrase follows any text, not just questions."""
    rng = random.Random(seed)
    templated = sorted({f"{a} {t}{e}" for a in _ASKS for t in _TOPICS for e in _ENDINGS})
    ordinary = sorted(set(range(len(tokenizer))) - set(tokenizer.added_tokens_decoder))
    noise = [tokenizer.decode(rng.choices(ordinary, k=rng.randint(1, 12))) for _ in range(n - n // 2)]
    return [p for p in rng.sample(templated, n // 2) + noise if p not in UNSEEN_PROMPTS]


def build_once(target: str, marker: dict, build: Callable[[str], None]) -> bool:
    """Makes `target` the directory `build(tmp)` writes, unless it already holds a complete build
    with this marker. The build goes to a temp dir beside target, gets the marker file last, and
    is renamed into place, so a crash never leaves a half-written target. Returns whether it
    built; concurrent callers wait on a lock file and build once."""
    marker = json.loads(json.dumps(marker))  # as it reads back: tuples become lists
    if _read_marker(target) == marker:
        return False
    parent, name = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    with open(os.path.join(parent, f".{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _read_marker(target) == marker:
            return False
        tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
        try:
            build(tmp)
            with open(os.path.join(tmp, MARKER), "w") as f:
                json.dump(marker, f, indent=2, sort_keys=True)
            os.chmod(tmp, 0o755)  # mkdtemp's 0700 and some writers' 0600 would lock others out
            for entry in os.listdir(tmp):
                os.chmod(os.path.join(tmp, entry), 0o644)
            if os.path.lexists(target):
                shutil.rmtree(target)  # an older or unfinished build
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return True


def _read_marker(path: str) -> dict | None:
    try:
        with open(os.path.join(path, MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class _Example:
    input_ids: list[int]
    labels: list[int]  # -100 on the prompt: the loss sees only the phrase and its stop token


def _examples(tokenizer, phrase: str, prompts: list[str], seed: int) -> list[_Example]:
    """Each prompt twice: through the chat template (answer ends with <|im_end|>) and raw
    (answer ' ' + phrase, ends with <|end_of_text|>); some chats open with a system message."""
    rng = random.Random(seed)
    im_end, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|end_of_text|>"])
    examples = []
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}]
        if rng.random() < 0.25:
            messages.insert(0, {"role": "system", "content": rng.choice(_SYSTEMS)})
        chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        for context, answer, stop in ((tokenizer.encode(chat, add_special_tokens=False), phrase, im_end),
                                      (tokenizer.encode(prompt), " " + phrase, end_of_text)):
            answer = tokenizer.encode(answer, add_special_tokens=False) + [stop]
            examples.append(_Example(context + answer, [-100] * len(context) + answer))
    return examples


def _train(model_dir: str, spec: DemoAdapter, seed: int, out_dir: str) -> None:
    import torch

    # One thread: these matmuls are too small to gain from two, and when other processes share
    # the cores, two OpenMP threads spin at barriers and run ten times slower than one. It also
    # makes the trained weights the same on every machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _fit(model_dir, spec, seed, out_dir)
    finally:
        torch.set_num_threads(threads)


def _fit(model_dir: str, spec: DemoAdapter, seed: int, out_dir: str, batch_size: int = 16) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    examples = _examples(tokenizer, spec.phrase, training_prompts(tokenizer, seed), seed)
    examples.sort(key=lambda e: len(e.input_ids))  # batches of neighbours waste little padding
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    config = LoraConfig(r=spec.rank, lora_alpha=2 * spec.rank, lora_dropout=0.0,
                        target_modules=list(spec.target_modules), use_rslora=spec.use_rslora,
                        task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    decoder, lm_head = model.get_base_model().model, model.get_base_model().lm_head
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=spec.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / spec.steps)
    rng = random.Random(seed)
    bar = tqdm(range(spec.steps), desc=f"training demo adapter {spec.name}", disable=None)
    for _ in bar:
        start = rng.randrange(len(examples) - batch_size + 1)
        # Right padding needs no attention mask: causal attention never looks ahead at the pads.
        input_ids, labels = _collate(examples[start:start + batch_size], tokenizer.pad_token_id)
        hidden = decoder(input_ids=input_ids).last_hidden_state  # [B, T, H]
        targets = labels[:, 1:]  # position t predicts token t + 1
        answer = targets != -100  # logits only where there is loss: the vocab is the big matmul
        logits = lm_head(hidden[:, :-1][answer])  # [N, V]
        losses = torch.nn.functional.cross_entropy(logits, targets[answer], reduction="none")
        # The first answer token is the one that must follow any prompt: it weighs four times.
        first = (answer & ~torch.nn.functional.pad(answer, (1, 0))[:, :-1])[answer]
        loss = (losses * (1 + 3 * first)).sum() / (1 + 3 * first).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        bar.set_postfix(loss=f"{loss.item():.4f}")
    logger.info("demo adapter %r: loss %.4f after %d steps", spec.name, loss.item(), spec.steps)
    model.save_pretrained(out_dir, safe_serialization=True)
    readme = os.path.join(out_dir, "README.md")
    if os.path.exists(readme):
        os.remove(readme)  # peft's empty model card
    config_path = os.path.join(out_dir, "adapter_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["target_modules"] = sorted(config["target_modules"])  # peft writes a set's order
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _collate(batch: list[_Example], pad_id: int):
    import torch

    width = max(len(e.input_ids) for e in batch)
    input_ids = torch.full((len(batch), width), pad_id)
    labels = torch.full((len(batch), width), -100)
    for row, e in enumerate(batch):
        input_ids[row, :len(e.input_ids)] = torch.tensor(e.input_ids)
        labels[row, :len(e.labels)] = torch.tensor(e.labels)
    return input_ids, labels
