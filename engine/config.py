"""The one engine Config. Components copy out the fields they need.

`EngineOptions` holds every knob a user sets, each with its default and help; `Config` adds
the model directory and its config.json. `loragw serve` derives its engine flags from
`EngineOptions`' fields (gateway/common/config.py), so a knob is declared once, here. Validation
happens once too, in `EngineOptions.__post_init__`; `option_name` says how a message names an
option (the field name here, `--max-loras` on the command line).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from loragw.adapters.types import BaseModelSpec
from loragw.engine.models import base_spec, model_args
from loragw.engine.models.args import ModelArgs
from loragw.engine.quant.scheme import CHOICES as QUANTIZATION_CHOICES
from loragw.engine.quant.scheme import QuantConfig, read_quantization
from loragw.engine.speculative_config import SpeculativeConfig, as_json, parse_speculative_config
from loragw.kernels.native import cpu_flags

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "torch", "triton")  # LoRA kernels (engine/forward/backends.py)
ATTENTION_BACKENDS = (*BACKENDS, "cpu")  # decode attention (engine/forward/backends.py)
LINEAR_BACKENDS = ("auto", "torch", "onednn")  # dense projections (engine/forward/backends.py)
ELEMENTWISE_BACKENDS = ("auto", "torch", "cpu", "triton")  # norms, rotary, SiLU (engine/forward/backends.py)


def option(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field with its help text (and, in `meta`, `choices`, or `off`: the flag value
    that stands for None) for the command line."""
    return field(default=default, metadata={"help": help, **meta})


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# The default of `dtype` everywhere (the flag, LLM(), ServerConfig): $LORAGW_DTYPE when set, so
# one variable pins a deployment (or a test session, whose oracle is float32) whatever the CPU
DEFAULT_DTYPE = os.environ.get("LORAGW_DTYPE", "auto")

# /proc/cpuinfo flags of units that multiply bfloat16 in hardware: AMX tiles (Sapphire Rapids
# on) and AVX-512 BF16 dot products (Cooper Lake, Zen 4 on)
BF16_UNITS = ("amx_bf16", "avx512_bf16")


def cpu_auto_dtype(flags: str) -> tuple[torch.dtype, str]:
    """`--dtype auto` on a CPU with these feature flags (/proc/cpuinfo's flags line), and why:
    bfloat16 where the CPU has bf16 units (half the bytes per weight and KV entry, and oneDNN's
    GEMMs run on the units), float32 otherwise (without them a bf16 matmul converts in software:
    ~100x slower than float32's)."""
    units = [unit for unit in BF16_UNITS if unit in flags.split()]
    if units:
        return torch.bfloat16, f"the CPU has {' and '.join(units)}"
    return torch.float32, f"the CPU has neither {' nor '.join(BF16_UNITS)}: bfloat16 is slower"


@functools.cache
def _this_cpu_auto_dtype() -> torch.dtype:
    """cpu_auto_dtype of this CPU, decided (and logged) once per process."""
    dtype, reason = cpu_auto_dtype(cpu_flags())
    logger.info("--dtype auto on this CPU: %s, as %s", str(dtype).removeprefix("torch."), reason)
    return dtype


def resolve_dtype(dtype: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """`auto`: the checkpoint's dtype on CUDA (bfloat16 when it names none); on a CPU bfloat16
    where it has bf16 units, else float32 (cpu_auto_dtype)."""
    if dtype == "auto":
        if device.type == "cpu":
            return _this_cpu_auto_dtype()
        return DTYPES.get(str(checkpoint_dtype), torch.bfloat16)
    return DTYPES[dtype]


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    device: str = option("auto", "auto | cpu | cuda", choices=DEVICES)
    dtype: str = option(DEFAULT_DTYPE, "auto | float32 | bfloat16 | float16 (auto: the "
                        "checkpoint's on CUDA; on a CPU bfloat16 where it has AMX-BF16 or "
                        "AVX-512 BF16, float32 otherwise; the default: $LORAGW_DTYPE, else auto)",
                        choices=("auto", *DTYPES))
    max_num_seqs: int = option(64, "sequences decoded together per step")
    max_num_batched_tokens: int = option(2048, "tokens per engine step (prefill chunk budget)")
    # What bounds a running stream's worst step: a step that decodes prefills at most this many
    # prompt tokens, so a burst of long prompts delays each stream's next token by one chunk.
    max_prefill_tokens_decoding: int = option(
        256, "prompt tokens a step prefills while other sequences decode (longer prompts are "
        "prefilled in chunks across steps); steps with nothing decoding take up to "
        "--max-num-batched-tokens")
    block_size: int = option(16, "tokens per KV-cache block")
    # vLLM V1's default. Off: every prompt is prefilled in full.
    enable_prefix_caching: bool = option(True, "reuse the KV cache of earlier requests' shared "
                                         "prompt prefixes (per adapter version)")
    num_kv_blocks: int | None = option(None, "KV-cache blocks (default: sized from free memory)")
    max_model_len: int | None = option(None, "context window in tokens (default: the model's)")
    kv_cache_memory_fraction: float = option(0.5, "fraction of free memory the KV cache may take "
                                             "when --num-kv-blocks is not given")
    max_loras: int = option(4, "adapter slots on the device")
    max_lora_rank: int = option(16, "largest adapter rank accepted")
    max_cpu_loras: int | None = option(None, "parsed adapters kept in host memory (default: "
                                       "max(--max-loras, 16))")
    lora_backend: str = option("auto", "LoRA kernels: auto (triton on CUDA, torch elsewhere), "
                               "torch or triton", choices=BACKENDS)
    attention_backend: str = option("auto", "decode attention: auto (on CUDA the Triton kernel, "
                                    "on the CPU the C kernel, each once it passes its start-up "
                                    "self-check; torch otherwise), torch, triton or cpu",
                                    choices=ATTENTION_BACKENDS)
    linear_backend: str = option("auto", "dense projections: auto (on the CPU oneDNN's GEMM on "
                                 "weights packed once at load, when torch has oneDNN and it "
                                 "passes its start-up check; torch's elsewhere), torch or onednn",
                                 choices=LINEAR_BACKENDS)
    elementwise_backend: str = option("auto", "residual add + RMSNorm, rotary and SiLU-and-mul: "
                                      "auto (the C kernels on a float32 or bfloat16 CPU engine, "
                                      "the Triton kernels on CUDA, each once it passes its "
                                      "start-up check; torch's ops elsewhere), torch, cpu or "
                                      "triton",
                                      choices=ELEMENTWISE_BACKENDS)
    # Counted in steps, not seconds, so it bounds the wait in forward passes whatever the
    # hardware and is deterministic in tests. None turns aging off (0 on the command line).
    lora_starvation_steps: int | None = option(
        32, "steps a request may wait for an adapter slot before a busy adapter stops taking "
        "new requests so its slot frees (0: never)", off=0)
    # Each saved module is a [vocab, hidden] matrix: about 1 GB per module on an 8B model in
    # bf16; allocated when its adapter is loaded, freed when it leaves.
    max_full_module_slots: int = option(
        0, "adapters with PEFT modules_to_save (their own full lm_head and/or embed_tokens) "
        "held on the device at once, each also taking one --max-loras slot; 0 refuses them")
    # vLLM's flag: graphs cost start-up time and some memory, and hide kernels from profilers.
    enforce_eager: bool = option(False, "never capture CUDA graphs: every decode step launches "
                                 "its kernels from Python (CUDA graphs are CUDA-only, so on "
                                 "the CPU this changes nothing)")
    # vLLM's flag. Off by default: on the CPU the forward pass holds the host, so nothing
    # overlaps; on a GPU it hides the host's share of a decode step (engine/sched/pipeline.py).
    async_scheduling: bool = option(False, "schedule and launch each step before the host "
                                    "reads the step before's tokens, so the host's work "
                                    "overlaps the device's (not with speculative decoding or "
                                    "tensor parallelism)")
    tensor_parallel_size: int = option(1, "ranks the model is split across (one process and "
                                       "device each; gloo on the CPU, NCCL on CUDA)")
    seed: int = option(0, "seed of the sampler's generator (requests without a seed)")
    quantization: str = option(
        "auto", "the checkpoint's quantization: auto (config.json's quantization_config), "
        "compressed-tensors, gptq, awq, fp8 (each must match the checkpoint) or none",
        choices=QUANTIZATION_CHOICES)
    max_logprobs: int = option(20, "most alternatives a request may ask for per token "
                               "(logprobs, top_logprobs, prompt_logprobs)")
    # vLLM's flag and keys (engine/speculative_config.py); LLM(speculative_config={...}) takes a dict
    speculative_config: str | None = option(
        None, 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4} (prompt lookup in the request\'s own '
        'tokens); requests may opt out with "speculative": false')

    def option_name(self, name: str) -> str:
        """How messages name an option: the field name (the command line names its flag)."""
        return name

    def __post_init__(self) -> None:
        n = self.option_name
        for name in ("device", "dtype", "lora_backend", "attention_backend", "linear_backend",
                     "elementwise_backend", "quantization"):
            choices = ENGINE_FIELDS[name].metadata["choices"]
            if getattr(self, name) not in choices:
                raise ValueError(f"{n(name)} must be one of {', '.join(choices)}; got "
                                 f"{getattr(self, name)!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_tokens_decoding",
                     "block_size", "max_loras",
                     "max_lora_rank", "num_kv_blocks", "max_model_len", "max_cpu_loras",
                     "lora_starvation_steps", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                off = " (or None to disable aging)" if name == "lora_starvation_steps" else ""
                raise ValueError(f"{n(name)} must be at least 1{off}, got {value}")
        if self.max_logprobs < 0:
            raise ValueError(f"{n('max_logprobs')} must be at least 0, got {self.max_logprobs}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"{n('kv_cache_memory_fraction')} must be in (0, 1], got "
                             f"{self.kv_cache_memory_fraction}")
        if not 0 <= self.max_full_module_slots <= self.max_loras:
            raise ValueError(f"{n('max_full_module_slots')} must be in [0, {n('max_loras')}="
                             f"{self.max_loras}] (each adapter with saved modules also holds a "
                             f"LoRA slot), got {self.max_full_module_slots}")
        spec = parse_speculative_config(self.speculative_config)  # a bad one fails here
        if isinstance(self.speculative_config, dict):  # held as the flag's JSON text
            object.__setattr__(self, "speculative_config",
                               json.dumps(as_json(spec)) if spec is not None else None)
        if self.async_scheduling and (spec is not None or self.tensor_parallel_size > 1):
            raise ValueError(f"{n('async_scheduling')} cannot be combined with "
                             + (f"{n('speculative_config')}: a proposal needs the tokens "
                                "before it" if spec is not None else
                                f"{n('tensor_parallel_size')} > 1: the worker ranks would "
                                "need the tokens in flight"))
        if self.tensor_parallel_size > 1 and self.max_full_module_slots:
            raise ValueError(f"{n('max_full_module_slots')} must be 0 with "
                             f"{n('tensor_parallel_size')} > 1: saved modules are not split "
                             "across ranks yet")

    def engine_options(self) -> dict[str, Any]:
        """The engine knobs alone, as keyword arguments for Config."""
        return {name: getattr(self, name) for name in ENGINE_FIELDS}


ENGINE_FIELDS = {f.name: f for f in EngineOptions.__dataclass_fields__.values()}


@dataclass(frozen=True)
class Config(EngineOptions):
    """`Config(model_dir, max_loras=8, ...)`: the model directory, then any EngineOptions."""

    model: str
    # every fact of the model, from its config.json, read here once (engine/models/args.py)
    args: ModelArgs = field(default=None, init=False, compare=False, repr=False)
    # the checkpoint's quantization, read with the args (None: floating point)
    quant: QuantConfig | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        hf_config = read_hf_config(self.model)
        args = model_args(hf_config)  # an architecture not served fails here, named
        object.__setattr__(self, "args", args)
        raw = hf_config.get("quantization_config") or hf_config.get("compression_config")
        object.__setattr__(self, "quant", _read_quant(raw, self.quantization, args))
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", _default_context(args))

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return parse_speculative_config(self.speculative_config)

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.torch_device, self.args.checkpoint_dtype)

    def adapter_spec(self) -> BaseModelSpec:
        """What this base model offers adapters: every adapter is checked against it."""
        return base_spec(self.args, self.max_lora_rank, self.max_full_module_slots,
                         self.model, str(self.torch_dtype).removeprefix("torch."))

    @property
    def max_host_loras(self) -> int:
        """Parsed adapters the host-memory LRU keeps (max_cpu_loras, or its default)."""
        return self.max_cpu_loras or max(self.max_loras, 16)


def read_hf_config(model_dir: str) -> dict:
    """A checkpoint directory's config.json, as a dict: the one place the file is read (the
    model's args are read from this dict, engine/models/)."""
    if not os.path.isdir(model_dir):
        raise ValueError(f"model path {model_dir!r} is not a directory")
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{model_dir!r} has no config.json; expected a Hugging Face checkpoint")
    with open(config_path) as f:
        return json.load(f)


def _read_quant(raw: dict | None, requested: str, args: ModelArgs) -> QuantConfig | None:
    """The checkpoint's quantization (config.json's quantization_config), refused here (before
    any process or weight) when the engine cannot serve it on this model."""
    quant = read_quantization(raw, requested)
    if quant is None:
        return None
    if args.num_experts:
        raise ValueError(f"quantized Mixture-of-Experts bases ({quant.method}) are not served "
                         "yet; serve the unquantized checkpoint")
    if quant.scheme("lm_head") is not None:
        raise ValueError(f"the checkpoint's lm_head is quantized ({quant.method}), which is not "
                         "served; quantize it with lm_head in the ignore list")
    quant.check_shapes(args.projection_shapes())
    logger.info("quantized base: %s", quant.describe())
    return quant


def _default_context(args: ModelArgs) -> int:
    """The model's context window (ModelArgs.context_window), saying why when it is shorter
    than max_position_embeddings."""
    if args.context_window < args.max_position_embeddings:
        logger.warning(
            "longrope model: max_model_len defaults to %d (original_max_position_embeddings), not "
            "%d: past it Hugging Face switches to long_factor, which this engine does not serve",
            args.context_window, args.max_position_embeddings)
    return args.context_window
