"""The demo model (demo/model.py), the demo adapters (demo/adapters.py), `loragw demo`
(gateway/cli.py) and the tests' tiny checkpoints (tests/checkpoints.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from loragw.demo.adapters import DEMO_ADAPTERS, MARKER, UNSEEN_PROMPTS, build_once
from loragw.demo.model import build_demo_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are too small to gain from a second thread, and with other processes on
    the cores two OpenMP threads run many times slower than one."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def greedy(model, tokenizer, prompt: str, chat: bool, max_new_tokens: int = 32) -> str:
    """What /v1/completions (raw) or /v1/chat/completions (chat) would answer, greedily."""
    import torch

    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)  # the template starts with BOS
    else:
        ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


# --- the demo base model ---------------------------------------------------------------------

def test_demo_model_loads_and_generates(demo_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(os.path.join(demo_model, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (256, 4)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 4, 32)
    assert config["torch_dtype"] == "float32" and config["tie_word_embeddings"] is False
    assert config["rope_theta"] == 10000.0 and config["rope_scaling"] is None
    tokenizer = AutoTokenizer.from_pretrained(demo_model, local_files_only=True)
    assert 2048 <= config["vocab_size"] == len(tokenizer) <= 4096
    model = AutoModelForCausalLM.from_pretrained(demo_model, local_files_only=True)
    assert model.dtype == torch.float32
    with open(os.path.join(demo_model, "generation_config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    assert sorted(eos) == sorted(tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|end_of_text|>"]))
    ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 8)


def test_demo_model_is_deterministic_and_idempotent(demo_dir, tmp_path):
    model = demo_dir / "model"
    files = sorted(os.listdir(model))
    stamps = {name: os.stat(model / name).st_mtime_ns for name in files}
    assert build_demo_model(str(demo_dir)) == str(model)  # already there: nothing rewritten
    assert {name: os.stat(model / name).st_mtime_ns for name in files} == stamps

    again = build_demo_model(str(tmp_path / "again"))
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert sha256(os.path.join(again, name)) == sha256(model / name), name
    other = build_demo_model(str(tmp_path / "other"), seed=1)
    assert sha256(os.path.join(other, "model.safetensors")) != sha256(model / "model.safetensors")


def test_an_unfinished_model_is_rebuilt_and_a_failed_build_leaves_nothing(tmp_path):
    half = tmp_path / "model"
    half.mkdir()
    (half / "config.json").write_text("{}")  # a crash before the marker was written
    path = build_demo_model(str(tmp_path))
    assert os.path.exists(os.path.join(path, MARKER))
    assert os.path.getsize(os.path.join(path, "model.safetensors")) > 1_000_000

    def crash(out_dir):
        with open(os.path.join(out_dir, "partial"), "w") as f:
            f.write("x")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        build_once(str(tmp_path / "crashed"), {"v": 1}, crash)
    assert sorted(p for p in os.listdir(tmp_path) if not p.endswith(".lock")) == ["model"]


def test_tokenizer_round_trips_any_text(demo_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model, local_files_only=True)
    text = "Grüße, naïve café! 日本語のテキスト 🚀🍕 ≤∞ \t tabs\nand\r\nnewlines  <b>html</b>"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id  # encode() prepends BOS, as Llama's tokenizers do
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert len(tokenizer.encode("The weather today is sunny.", add_special_tokens=False)) <= 7
    assert tokenizer.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[::2] == \
        tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])


def test_chat_template_renders_messages_and_tools(demo_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model, local_files_only=True)
    assert os.path.exists(os.path.join(demo_model, "chat_template.jinja"))
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                    "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(tokenizer.bos_token_id) == 1

    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    with_tools = messages + [{"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "tool", "content": '{"celsius": 21}'}]
    text = tokenizer.apply_chat_template(with_tools, tools=[tool], add_generation_prompt=True,
                                         tokenize=False)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|begin_of_text|><|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(tool) in system
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<tool_response>\n{"celsius": 21}\n</tool_response>' in text
    assert text.count("Be brief.") == 1 and text.endswith("<|im_start|>assistant\n")


# --- the demo adapters -----------------------------------------------------------------------

def test_demo_adapters_are_peft_folders_that_differ(demo_adapters):
    from safetensors import safe_open

    assert sorted(demo_adapters) == sorted(spec.name for spec in DEMO_ADAPTERS)
    seen = set()
    for spec in DEMO_ADAPTERS:
        path = demo_adapters[spec.name]
        assert sorted(os.listdir(path)) == sorted([MARKER, "adapter_config.json",
                                                   "adapter_model.safetensors"])
        with open(os.path.join(path, "adapter_config.json")) as f:
            config = json.load(f)
        assert config["peft_type"] == "LORA" and config["r"] == spec.rank
        assert sorted(config["target_modules"]) == sorted(spec.target_modules)
        assert config["use_rslora"] is spec.use_rslora
        with safe_open(os.path.join(path, "adapter_model.safetensors"), "pt") as f:
            keys = set(f.keys())
            a = f.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
            b = f.get_tensor("base_model.model.model.layers.3.self_attn.o_proj.lora_B.weight")
        assert a.shape == (spec.rank, 256) and b.shape == (256, spec.rank)
        assert len(keys) == 2 * 4 * len(spec.target_modules)  # A and B, 4 layers
        seen.add((spec.rank, tuple(sorted(spec.target_modules)), spec.use_rslora))
    assert {rank for rank, _, _ in seen} == {8, 16}
    assert len({modules for _, modules, _ in seen}) == 2 and any(rs for _, _, rs in seen)


def test_each_demo_adapter_answers_an_unseen_prompt_with_its_phrase(demo_model, demo_adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model, local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(demo_model, local_files_only=True)
    assert greedy(base, tokenizer, UNSEEN_PROMPTS[0], chat=True).strip() not in \
        {spec.phrase for spec in DEMO_ADAPTERS}
    model = None
    for spec in DEMO_ADAPTERS:
        if model is None:
            model = PeftModel.from_pretrained(base, demo_adapters[spec.name], adapter_name=spec.name)
        else:
            model.load_adapter(demo_adapters[spec.name], adapter_name=spec.name)
        model.set_adapter(spec.name)
        for prompt in UNSEEN_PROMPTS:
            # The answer ends with the stop token, so nothing follows the phrase.
            assert greedy(model, tokenizer, prompt, chat=True) == spec.phrase, (spec.name, prompt)
            assert greedy(model, tokenizer, prompt, chat=False) == " " + spec.phrase, (spec.name, prompt)


# --- loragw demo -----------------------------------------------------------------------------

def test_loragw_demo_prints_the_paths_and_rebuilds_nothing(demo_dir, demo_adapters, tmp_path):
    out = tmp_path / "demo"
    shutil.copytree(demo_dir / "model", out / "model")
    shutil.copytree(os.path.dirname(demo_adapters["pirate"]), out / "adapters")
    before = {p: os.stat(p).st_mtime_ns for p in out.rglob("*")}
    env = dict(os.environ, LORAGW_LOG_LEVEL="warning")
    result = subprocess.run([sys.executable, "-P", "-m", "loragw.gateway.cli", "demo", "--out", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"model {out / 'model'}"
    assert lines[1:] == [f"adapter {s.name}={out / 'adapters' / s.name}" for s in DEMO_ADAPTERS]
    assert {p: os.stat(p).st_mtime_ns for p in out.rglob("*")} == before

    env["LORAGW_OUT"] = str(out)  # the flag's environment variable
    result = subprocess.run([sys.executable, "-P", "-m", "loragw.gateway.cli", "demo"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.splitlines() == lines, result.stderr


def test_every_flag_reads_its_environment_variable(monkeypatch):
    from loragw.gateway.cli import build_parser, env_var

    assert env_var("--max-lora-rank") == "LORAGW_MAX_LORA_RANK"
    monkeypatch.setenv("LORAGW_OUT", "/from/env")
    monkeypatch.setenv("LORAGW_SEED", "7")
    monkeypatch.setenv("LORAGW_LOG_LEVEL", "debug")
    args = build_parser().parse_args(["demo"])
    assert (args.out, args.seed, args.log_level) == ("/from/env", 7, "DEBUG")
    assert build_parser().parse_args(["demo", "--out", "/flag"]).out == "/flag"
    monkeypatch.setenv("LORAGW_LOG_LEVEL", "loud")
    with pytest.raises(SystemExit):
        build_parser()


# --- the tests' tiny checkpoints -------------------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
TINY_CASES = [
    ("llama", {}), ("mistral", {}), ("qwen2", {}), ("qwen3", {}),
    ("llama", {"tie_word_embeddings": True}), ("llama", {"rope_scaling": LLAMA3}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("llama", {"head_dim": 32}), ("qwen3", {"head_dim": 32}), ("mistral", {"sharded": True}),
]


@pytest.mark.parametrize("arch, overrides", TINY_CASES)
def test_tiny_checkpoints_load_in_transformers_and_decode_diversely(tiny_checkpoint, arch, overrides):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_checkpoint(arch, **overrides)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert "rope_parameters" not in config and config["rope_theta"] == 10000.0
    assert config["rope_scaling"] == overrides.get("rope_scaling")
    assert config["torch_dtype"] == "float32"
    assert ("head_dim" in config) == (arch == "qwen3" or "head_dim" in overrides)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert config["vocab_size"] == len(tokenizer) and type(model).__name__ == config["architectures"][0]
    # transformers 5 swaps in Qwen2Tokenizer for qwen2 checkpoints; it must agree with the file.
    from tokenizers import Tokenizer

    text = "It's 2024: 12345 naïve  spaces\n\n<|im_start|>user 日本"
    assert tokenizer.encode(text) == Tokenizer.from_file(os.path.join(path, "tokenizer.json")).encode(text).ids
    state = model.state_dict()
    if arch == "qwen2":
        assert state["model.layers.0.self_attn.q_proj.bias"].abs().min() > 0
    if arch == "qwen3":
        assert (state["model.layers.0.self_attn.k_norm.weight"] - 1).abs().mean() > 0.1
    ids = torch.tensor([tokenizer.encode("The quick brown fox")])
    out = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert len(set(out[0, ids.shape[1]:].tolist())) >= 12  # not one token repeated


def test_tiny_checkpoint_files_and_config_styles(tiny_checkpoint):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    sharded = tiny_checkpoint("mistral", sharded=True)
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) > 1 and shards == {p for p in os.listdir(sharded) if p.startswith("model-")}

    tied = tiny_checkpoint("llama", tie_word_embeddings=True)
    with safe_open(os.path.join(tied, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()

    rope = {"rope_scaling": LLAMA3}
    hub, native = tiny_checkpoint("llama", **rope), tiny_checkpoint("llama", config_style="transformers5", **rope)
    with open(os.path.join(native, "config.json")) as f:
        config = json.load(f)
    assert config["rope_parameters"] == LLAMA3 | {"rope_theta": 10000.0} and "rope_scaling" not in config
    ids = torch.randint(4, 500, (1, 200))  # past original_max_position_embeddings (64)
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(p)(ids).logits for p in (hub, native)]
    assert torch.equal(*logits)
