"""Real quantized checkpoints of a tiny random base, with transformers + PEFT's answers, for the
quantized-base tests; and broken copies of them for the loader's checks.

The tools that write them (llm-compressor, compressed-tensors, AutoRound) pin a transformers of
their own, so they live in a venv of their own (`make quant-tools`: .venv-quant, or the python
named by LORAGW_QUANT_PYTHON): `build_world` runs tests/quant_reference/make.py there, once,
in one subprocess, and caches the result in out_dir/world.json (a later call with the same
request, made by the same scripts, reads it back). tests/quant_reference/ says how each scheme is written
(schemes.py), what its tensors mean (formats.py), and how the oracle reads it (reference.py).

    world = build_world(str(tmp_path), "llama", ["w4a16-g128", "gptq-g32"])
    world.checkpoints["gptq-g32"].dir       # the quantized checkpoint
    world.checkpoints["gptq-g32"].expected  # the oracle's tokens per request
    world.requests                          # [(prompt token ids, adapter or None), ...]
    world.adapters                          # {name: PEFT dir}, made on the float base

Every scheme's tokens differ from the float base's (`expected_float`) in at least one request,
so a loader that drops a scale or a zero point fails. For schemes whose forward quantizes each
Linear's input on the fly (`activations`: w8a8*, fp8-*, hf-fp8-block: compressed-tensors'
input_activations, Hugging Face fp8's activation_scheme), `expected` is that forward's and
`expected_weight_only` holds the answers with it turned off, which differ in at least one
request (the oracle really quantizes them); for every other scheme the two are equal.

Those schemes round every Linear input to 255 levels, so a float32 rounding difference upstream
(RMSNorm, attention: two implementations, ~1e-7 relative apart) can move an input across a
rounding boundary: one code, ~1e-3 on the logits. `check` therefore lets such a request take
the oracle's runner-up where the oracle itself chose by less than NEAR_TIE nats (`margins`),
and compares it up to there; every other token must be the oracle's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
QUANT_PYTHON = Path(os.environ.get("LORAGW_QUANT_PYTHON", REPO / ".venv-quant" / "bin" / "python"))
MAKE = REPO / "tests" / "quant_reference" / "make.py"
BUILD_TIMEOUT_S = 900

VOCAB = 384
MAX_TOKENS = 10
ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# LoraConfig keyword arguments: attention only, all seven projections, two more ranks.
ADAPTERS = {
    "attn-r8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj",
                                                             "o_proj"]},
    "all-r16": {"r": 16, "lora_alpha": 16, "target_modules": ALL_SEVEN},
    "qv-r4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
}
# An activation-quantizing scheme's request may take the oracle's runner-up where the oracle led
# it by less than this (log-probability, nats): see the module docstring.
NEAR_TIE = 0.01
# Prompt lengths, one per request of make_requests, in order.
LENGTHS = (5, 1, 17, 9, 23, 3, 12, 7, 14, 2, 19, 6, 11, 8, 4, 10, 13, 16, 3)


def _scheme_names() -> tuple[str, ...]:
    """The names of tests/quant_reference/schemes.py's SCHEMES (it imports only torch at
    module level, so it loads here too)."""
    path = REPO / "tests" / "quant_reference" / "schemes.py"
    spec = importlib.util.spec_from_file_location("quant_reference_schemes", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return tuple(module.SCHEMES)


ALL_SCHEMES = _scheme_names()


class QuantToolsMissing(RuntimeError):
    pass


@dataclass(frozen=True)
class QuantCheckpoint:
    scheme: str  # a key of ALL_SCHEMES
    family: str  # "compressed-tensors", "gptq", "awq" or "fp8"
    dir: str  # the quantized checkpoint
    dequantized: str  # its float32 twin (tests/quant_reference/formats.py), a plain checkpoint
    activations: bool  # whether its forward quantizes Linear inputs
    expected: list[list[int]]  # the oracle's tokens per request of QuantWorld.requests
    margins: list[list[list[float]]]  # per expected token: [lead over the runner-up, its id]
    expected_weight_only: list[list[int]]  # the same without activation quantization
    max_weight_error: float  # largest relative RMS error of a Linear against the float base


@dataclass(frozen=True)
class QuantWorld:
    root: str
    arch: str
    base: str  # the float32 base the schemes were made from
    adapters: dict[str, str]  # name -> PEFT dir, saved on the float base
    requests: list[tuple[list[int], str | None]]  # (prompt token ids, adapter or None)
    max_tokens: int
    expected_float: list[list[int]]  # the float base's tokens per request
    checkpoints: dict[str, QuantCheckpoint]
    seconds: float  # how long building took (the subprocess's own count)

    @property
    def prompts(self) -> list[list[int]]:
        return [prompt for prompt, _ in self.requests]

    @property
    def request_adapters(self) -> list[str | None]:
        return [adapter for _, adapter in self.requests]

    def check(self, outputs, scheme: str, weight_only: bool = False) -> int:
        """Every output (in request order, with .token_ids) has the oracle's tokens; with
        activation quantization, up to a near tie where it took the runner-up (module
        docstring). Returns how many requests parted at a near tie."""
        checkpoint = self.checkpoints[scheme]
        expected = checkpoint.expected_weight_only if weight_only else checkpoint.expected
        ties = 0
        for i, (out, want) in enumerate(zip(outputs, expected, strict=True)):
            prompt, adapter = self.requests[i]
            got = out.token_ids
            part = next((k for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b),
                        None)
            tied = False
            if part is not None and checkpoint.activations and not weight_only:
                lead, runner_up = checkpoint.margins[i][part]
                tied = lead < NEAR_TIE and got[part] == runner_up
            ties += bool(tied)
            assert part is None or tied, (
                f"{scheme}: request {i} (adapter {adapter}, prompt of {len(prompt)} tokens) "
                f"gave {got}, transformers + PEFT {want}")
        return ties


def make_requests(adapter_names: list[str], seed: int = 7,
                  vocab: int = VOCAB) -> list[tuple[list[int], str | None]]:
    """Mixed requests: every adapter twice and the base model three times, random prompts of
    LENGTHS tokens."""
    order: list[str | None] = [*adapter_names, None, *reversed(adapter_names), None, None]
    assert len(order) <= len(LENGTHS), f"{len(adapter_names)} adapters: add prompt lengths"
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (n,), generator=g).tolist(), adapter)
            for n, adapter in zip(LENGTHS, order)]


def quant_python() -> Path:
    """The quant venv's python; raises QuantToolsMissing when it is not there."""
    if not os.access(QUANT_PYTHON, os.X_OK):
        raise QuantToolsMissing(
            f"no quantization venv at {QUANT_PYTHON}: run `make quant-tools` (it makes "
            ".venv-quant with llm-compressor), or point LORAGW_QUANT_PYTHON at its python")
    return QUANT_PYTHON


def build_world(out_dir: str, arch: str = "llama", schemes: list[str] | tuple[str, ...] =
                ALL_SCHEMES, adapters: dict[str, dict] | None = None,
                requests: list[tuple[list[int], str | None]] | None = None,
                max_tokens: int = MAX_TOKENS) -> QuantWorld:
    """The quantized world of `arch` ("llama", "qwen2") in out_dir: the float base, PEFT
    `adapters` (default ADAPTERS), one checkpoint per scheme, and the oracle's tokens for each
    of `requests` (default make_requests over the adapters). Built by one subprocess in the
    quant venv, or read back from out_dir/world.json when it holds this same request."""
    adapters = ADAPTERS if adapters is None else adapters
    requests = make_requests(list(adapters)) if requests is None else requests
    unknown = sorted(set(schemes) - set(ALL_SCHEMES))
    if unknown:
        raise ValueError(f"unknown schemes {unknown}; known: {', '.join(ALL_SCHEMES)}")
    request = {"arch": arch, "vocab": VOCAB, "schemes": list(schemes), "adapters": adapters,
               "requests": [[list(prompt), adapter] for prompt, adapter in requests],
               "max_tokens": max_tokens, "sources": _sources_digest()}
    root = Path(out_dir)
    cached = root / "world.json"
    if not (cached.exists() and json.loads(cached.read_text())["request"] == request):
        python = quant_python()
        root.mkdir(parents=True, exist_ok=True)
        cached.unlink(missing_ok=True)
        (root / "request.json").write_text(json.dumps(request, indent=1))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"}
        done = subprocess.run([str(python), str(MAKE), str(root)], env=env, text=True,
                              capture_output=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{MAKE.name} failed (exit {done.returncode}):\n"
                               f"{done.stderr[-6000:]}")
    return _read_world(root)


def _sources_digest() -> str:
    """A digest of tests/quant_reference/'s scripts: a world built by others is rebuilt."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(MAKE.parent.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def _read_world(root: Path) -> QuantWorld:
    world = json.loads((root / "world.json").read_text())
    request = world["request"]
    checkpoints = {
        name: QuantCheckpoint(scheme=name, family=entry["family"], dir=str(root / entry["dir"]),
                              dequantized=str(root / entry["dequantized"]),
                              activations=entry["activations"], expected=entry["expected"],
                              margins=entry["margins"],
                              expected_weight_only=entry["expected_weight_only"],
                              max_weight_error=entry["max_weight_error"])
        for name, entry in world["schemes"].items()}
    return QuantWorld(root=str(root), arch=request["arch"], base=str(root / world["base"]),
                      adapters={name: str(root / path) for name, path
                                in world["adapters"].items()},
                      requests=[(prompt, adapter) for prompt, adapter in request["requests"]],
                      max_tokens=request["max_tokens"], expected_float=world["expected_float"],
                      checkpoints=checkpoints, seconds=world["seconds"])


def corrupt(src_dir: str, out_dir: str, tensor_name: str, how: str) -> str:
    """A copy of checkpoint src_dir in out_dir with tensor `tensor_name` broken: how="nan"
    fills it with NaN (a floating tensor: a scale), how="shape" gives it one more row than it
    should have; returns out_dir."""
    import safetensors.torch

    if how not in ("nan", "shape"):
        raise ValueError(f"how must be 'nan' or 'shape'; got {how!r}")
    shutil.copytree(src_dir, out_dir, dirs_exist_ok=True)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = safetensors.torch.load_file(path)
    if tensor_name not in tensors:
        near = sorted(name for name in tensors if name.rpartition(".")[2]
                      == tensor_name.rpartition(".")[2])[:4]
        raise KeyError(f"{src_dir} has no tensor {tensor_name!r}; e.g. {near}")
    t = tensors[tensor_name]
    if how == "nan":
        if not t.dtype.is_floating_point:
            raise ValueError(f"{tensor_name} is {t.dtype}: NaN needs a floating tensor")
        tensors[tensor_name] = torch.full_like(t, float("nan"))
    else:
        raw = t.view(torch.uint8) if t.element_size() == 1 else t  # float8: no cat of its own
        tensors[tensor_name] = torch.cat([raw, raw[:1]]).view(t.dtype)
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    return out_dir


# Where GPTQ / AWQ tools also write the quantization config, beside config.json's copy:
# GPTQModel and AutoGPTQ (quantize_config.json), AutoRound (quantization_config.json).
SIDE_CONFIGS = ("quantize_config.json", "quantization_config.json")


def with_quant_config(src_dir: str, out_dir: str, edit) -> str:
    """A copy of checkpoint src_dir in out_dir whose config.json's quantization_config (and
    SIDE_CONFIGS, where there are some) went through `edit(dict)`, in place."""
    shutil.copytree(src_dir, out_dir, dirs_exist_ok=True)
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    edit(config["quantization_config"])
    _write_json(config_path, config)
    for name in SIDE_CONFIGS:
        side = os.path.join(out_dir, name)
        if os.path.exists(side):
            with open(side) as f:
                quant = json.load(f)
            edit(quant)
            _write_json(side, quant)
    return out_dir


def with_unknown_method(src_dir: str, out_dir: str, method: str = "mystery-int3") -> str:
    """A copy whose quantization_config names a quant_method no loader knows."""
    return with_quant_config(src_dir, out_dir, lambda quant: quant.update(quant_method=method))


def with_group_size(src_dir: str, out_dir: str, group_size: int = 48) -> str:
    """A copy whose quantization_config claims `group_size` (48 divides none of the inputs,
    128 and 256): compressed-tensors' weights.group_size, GPTQ / AWQ's group_size, or fp8's
    weight_block_size [group_size, group_size]."""
    def edit(quant: dict) -> None:
        if "config_groups" in quant:
            for group in quant["config_groups"].values():
                group["weights"]["group_size"] = group_size
        elif "weight_block_size" in quant:
            quant["weight_block_size"] = [group_size, group_size]
        else:
            quant["group_size"] = group_size
    return with_quant_config(src_dir, out_dir, edit)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
