"""The one ServerConfig: every `loragw serve` flag, each also read from `LORAGW_<FLAG>`.

Precedence: command line, then the environment (`LORAGW_MAX_LORAS=8`; lists comma-separated,
booleans 1/0/true/false; an empty value counts as unset), then the default below. `ServerConfig.from_args(ns)` applies it;
`ServerConfig(...)` directly (tests, benchmarks) takes values as given.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

ENV_PREFIX = "LORAGW_"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEMO_DIR = os.path.join("~", ".cache", "lora-gateway", "demo")


@dataclass(frozen=True)
class ServerConfig:
    model: str | None = None  # local checkpoint dir (Hub ids: a later issue)
    demo: bool = False  # serve the demo model and adapters from ~/.cache/lora-gateway/demo
    served_model_name: str | None = None  # default: the model dir's basename ("demo" for --demo)
    adapter: tuple[str, ...] = ()  # NAME=SOURCE, registered at start-up
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_starvation_steps: int = 32  # 0 turns slot aging off
    max_full_module_slots: int = 0  # adapters with modules_to_save on the device; 0 refuses them
    adapter_dir: str | None = None
    hub_allow: tuple[str, ...] = ()
    redis_url: str | None = None
    replica_id: str | None = None
    advertise_url: str | None = None
    api_key: str | None = None
    admin_key: str | None = None
    max_upload_mb: int = 512
    max_waiting: int = 256  # requests beyond max_num_seqs before 429

    def __post_init__(self) -> None:
        if self.model is None and not self.demo:
            raise ValueError("give --model PATH (a local checkpoint directory) or --demo")
        if self.model is not None and self.demo:
            raise ValueError("--model and --demo exclude each other; pass one")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}; got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank",
                     "max_upload_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be at least 1, got {getattr(self, name)}")
        for name in ("max_waiting", "lora_starvation_steps", "max_full_module_slots"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{_flag(name)} must be at least 0, got {getattr(self, name)}")
        if self.max_full_module_slots > self.max_loras:
            raise ValueError(f"--max-full-module-slots ({self.max_full_module_slots}) must not "
                             f"exceed --max-loras ({self.max_loras}): each adapter with saved "
                             "modules also holds a LoRA slot")
        for name in ("api_key", "admin_key"):
            if getattr(self, name) == "":
                raise ValueError(f"--{_flag(name)} is empty; give a key or leave the flag out")
        self.adapter_sources()  # NAME=SOURCE well-formed

    def adapter_sources(self) -> list[tuple[str, str]]:
        """The --adapter NAME=SOURCE pairs, in order."""
        pairs = []
        for entry in self.adapter:
            name, sep, source = entry.partition("=")
            if not sep or not name.strip() or not source.strip():
                raise ValueError(f"--adapter {entry!r} is not NAME=SOURCE; e.g. "
                                 "--adapter pirate=/models/pirate-lora")
            pairs.append((name.strip(), source.strip()))
        return pairs

    @property
    def model_name(self) -> str:
        """The name clients put in `model` to get the base model."""
        if self.served_model_name:
            return self.served_model_name
        if self.demo:
            return "demo"
        assert self.model is not None
        return os.path.basename(os.path.normpath(self.model)) or self.model

    @property
    def max_capacity(self) -> int:
        """Sequences the gateway admits at once (running plus queued) before answering 429."""
        return self.max_num_seqs + self.max_waiting

    @classmethod
    def from_args(cls, ns: argparse.Namespace,
                  environ: Mapping[str, str] | None = None) -> ServerConfig:
        environ = os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            value = getattr(ns, f.name, None)
            if value is None:
                raw = environ.get(_env(f.name))
                if raw is None or (raw.strip() == "" and _KINDS[f.name] in (str, int)):
                    continue  # unset, or set to nothing (LORAGW_API_KEY= means no key)
                value = _parse_env(f.name, raw, _KINDS[f.name])
            values[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _env(name: str) -> str:
    return ENV_PREFIX + name.upper()


# (kind, help); kind is the parser: str, int, bool or list (repeatable, comma-separated in env).
_FLAGS: dict[str, tuple[type, str]] = {
    "model": (str, "local checkpoint directory to serve (config.json, safetensors, tokenizer)"),
    "demo": (bool, f"serve the demo model and its adapters from {DEMO_DIR} (built if missing)"),
    "served_model_name": (str, "the `model` name of the base model (default: the model dir's "
                               "basename, 'demo' with --demo)"),
    "adapter": (list, "NAME=SOURCE adapter to register at start-up (repeatable); SOURCE is a "
                      "local PEFT dir"),
    "host": (str, "address to listen on"),
    "port": (int, "port to listen on (0: any free port)"),
    "device": (str, "auto | cpu | cuda"),
    "dtype": (str, "auto | float32 | bfloat16 | float16 (auto: float32 on CPU)"),
    "max_model_len": (int, "context window in tokens (default: the model's)"),
    "max_num_seqs": (int, "sequences decoded together per step"),
    "max_num_batched_tokens": (int, "tokens per engine step (prefill chunk budget)"),
    "enable_prefix_caching": (bool, "reuse the KV cache of earlier requests' shared prompt "
                                    "prefixes (per adapter version)"),
    "max_loras": (int, "adapter slots on the device"),
    "max_lora_rank": (int, "largest adapter rank accepted"),
    "max_cpu_loras": (int, "adapters kept in host memory (default: unbounded)"),
    "lora_starvation_steps": (int, "steps a request may wait for an adapter slot before a busy "
                                   "adapter stops taking new requests so its slot frees (0: "
                                   "never)"),
    "max_full_module_slots": (int, "adapters with PEFT modules_to_save (their own full lm_head "
                                   "and/or embed_tokens, a [vocab, hidden] matrix each: ~1 GB "
                                   "per module on an 8B model in bf16) held on the device at "
                                   "once, each also taking one --max-loras slot; 0 refuses "
                                   "such adapters"),
    "adapter_dir": (str, "directory where uploaded and downloaded adapters are stored"),
    "hub_allow": (list, "ORG/REPO glob of Hub adapters loaded on first use (repeatable)"),
    "redis_url": (str, "Redis URL of the adapter registry shared by replicas"),
    "replica_id": (str, "this replica's id in the registry (default: the host name)"),
    "advertise_url": (str, "URL other replicas and the router use to reach this one"),
    "api_key": (str, "Bearer key required on /v1/*"),
    "admin_key": (str, "Bearer key required on /admin/* and adapter load/unload"),
    "max_upload_mb": (int, "largest request body (adapter uploads), in MB"),
    "max_waiting": (int, "requests queued beyond --max-num-seqs before 429"),
}
_KINDS = {name: kind for name, (kind, _) in _FLAGS.items()}
assert set(_KINDS) == {f.name for f in fields(ServerConfig)}, "every field needs a flag"


def _parse_env(name: str, raw: str, kind: type):
    try:
        if kind is bool:
            lowered = raw.strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off", ""):
                raise ValueError("expected 1/0/true/false")
            return lowered in ("1", "true", "yes", "on")
        if kind is list:
            return [item.strip() for item in raw.split(",") if item.strip()]
        if kind is int:
            return int(raw)
        return raw
    except ValueError as exc:
        raise ValueError(f"environment variable {_env(name)}={raw!r} is invalid: {exc}") from None


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds every `loragw serve` flag. Unset flags stay None so from_args can fall back to env."""
    defaults = ServerConfig.__dataclass_fields__
    for name, (kind, help_text) in _FLAGS.items():
        default = defaults[name].default
        shown = "" if default in (None, ()) else f"; default {default}"
        full_help = f"{help_text} (env {_env(name)}{shown})"
        flag = "--" + _flag(name)
        if kind is bool:  # --flag / --no-flag: a flag that defaults on can be turned off
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=full_help)
        elif kind is list:
            parser.add_argument(flag, action="append", default=None, metavar=name.upper(),
                                help=full_help)
        else:
            parser.add_argument(flag, type=kind, default=None, help=full_help)
    return parser
