"""The one ServerConfig: every `loragw serve` flag, each also read from `LORAGW_<FLAG>`.

The engine's options are inherited from `engine.config.EngineOptions` (names, types, defaults,
help and validation declared there once); the fields below are the server's own. Flags and
the environment go through gateway/common/flags.py (`add_serve_arguments`, `ServerConfig.from_args`);
`ServerConfig(...)` directly (tests, benchmarks) takes values as given.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from dataclasses import dataclass

from loragw.demo import DEMO_DIR
from loragw.engine.api import REASONING_PARSERS, TOOL_CALL_PARSERS, EngineOptions, option
from loragw.gateway.common.flags import add_options, options_from

DEFAULT_ADAPTER_DIR = os.path.join("~", ".cache", "lora-gateway", "adapters")
MB = 1024 * 1024  # the unit of --max-upload-mb and --max-request-mb


@dataclass(frozen=True, kw_only=True)
class ServerConfig(EngineOptions):
    model: str | None = option(None, "local checkpoint directory to serve (config.json, "
                               "safetensors, tokenizer)")
    demo: bool = option(False, f"serve the demo model and its adapters from {DEMO_DIR} (built "
                        "if missing)")
    served_model_name: str | None = option(None, "the `model` name of the base model (default: "
                                           "the model dir's basename, 'demo' with --demo)")
    adapter: tuple[str, ...] = option((), "NAME=SOURCE adapter to register at start-up "
                                      "(repeatable); SOURCE is a local PEFT dir or a Hub repo")
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on (0: any free port)")
    adapter_dir: str | None = option(None, "directory where uploaded and downloaded adapters "
                                     f"are stored (default {DEFAULT_ADAPTER_DIR})")
    adapter_versions_kept: int = option(3, "versions of each adapter id kept (the newest and "
                                        "earlier ones a request may pin as ID@N); older ones "
                                        "leave the store")
    hub_allow: tuple[str, ...] = option((), "ORG/REPO glob of Hub adapters loaded on first use "
                                        "(repeatable)")
    s3_allow: tuple[str, ...] = option((), "BUCKET/PATH glob of s3:// adapters (PEFT folders) "
                                       "loaded on first use (repeatable)")
    adapter_store_url: str | None = option(
        None, "s3://BUCKET/PREFIX of the object store every replica shares adapter bytes "
        "through (uploads and path registrations are written to it; endpoint and credentials "
        "from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... or the AWS credential chain)")
    redis_url: str | None = option(None, "Redis URL of the adapter registry shared by replicas")
    replica_id: str | None = option(None, "this replica's id in the registry (default: the "
                                    "host name)")
    advertise_url: str | None = option(None, "URL other replicas and the router use to reach "
                                       "this one")
    replica_tokens_per_s: float = option(
        0.0, "tokens/s this replica serves at full load, what fleet placement sizes each "
        "adapter's copies by (0: measured while it is saturated)")
    demand_window_s: float = option(60.0, "seconds of traffic each adapter's demand is "
                                    "averaged over (fleet placement)")
    api_key: str | None = option(None, "Bearer key required on /v1/*")
    admin_key: str | None = option(None, "Bearer key required on /admin/* and adapter "
                                   "load/unload")
    tenant_key_cache_s: float = option(
        3600.0, "while Redis is unreachable, keep honouring the tenant keys this replica knows "
        "for this many seconds after its last read of them (unknown keys are always refused)")
    max_upload_mb: int = option(512, "largest adapter upload (POST /admin/adapters), in MB")
    max_request_mb: int = option(16, "largest JSON request body on every other route, in MB "
                                 "(413 past it)")
    upload_timeout_s: float = option(60.0, "an upload body that sends nothing for this many "
                                     "seconds is cut off (408)")
    body_seconds_per_mb: float = option(
        30.0, "every request body (JSON or upload) must arrive within --upload-timeout-s plus "
        "this many seconds per MB received so far (an average of at least 1/N MB/s once past "
        "--upload-timeout-s); a slower one, such as a drip of a byte a second, is cut off (408)")
    metrics_key: str | None = option(None, "Bearer key required on /metrics (its labels name "
                                     "adapters; default: open)")
    metrics_max_adapters: int = option(
        50, "adapters whose /metrics series carry their own adapter and version labels: the "
        "busiest by requests; the rest are summed under adapter=\"other\" (the label set stays "
        "bounded however many adapters are used)")
    health_timeout_s: float = option(30.0, "/health answers 503 once the engine loop has not "
                                     "answered a ping for this many seconds (a liveness probe "
                                     "then restarts the pod)")
    max_waiting: int = option(256, "requests queued beyond --max-num-seqs before 429")
    otlp_traces_endpoint: str | None = option(
        None, "OTLP over HTTP (protobuf) URL every request's trace spans are exported to, as "
        "vLLM's flag (e.g. http://collector:4318/v1/traces; a URL without a path gets "
        "/v1/traces); off, and free, when unset")
    chat_template: str | None = option(
        None, "chat template every chat request renders with instead of the model's: a file's "
        "path or the template's text")
    default_chat_template_kwargs: str | None = option(
        None, "JSON object of chat template kwargs every chat request renders with unless it "
        "sets them in chat_template_kwargs (e.g. '{\"enable_thinking\": false}')")
    reasoning_parser: str = option(
        "auto", "how the model writes its thinking, which goes to message.reasoning: auto (read "
        "from the chat template), none, or one of " + ", ".join(REASONING_PARSERS))
    tool_call_parser: str = option(
        "auto", "how the model writes tool calls: auto (read from the chat template), or one "
        "of " + ", ".join(TOOL_CALL_PARSERS))
    enable_auto_tool_choice: bool = option(
        True, "parse tool calls out of the answer under tool_choice auto (vLLM's flag; "
        "--no-enable-auto-tool-choice: only a required or named tool choice calls tools)")
    exclude_tools_when_tool_choice_none: bool = option(
        False, "leave the tools out of the prompt of a request with tool_choice none (vLLM's "
        "flag; by default the template still shows them, and no call is parsed)")
    trust_request_chat_template: bool = option(
        False, "let a chat request's own chat_template render its prompt (vLLM's flag; "
        "without it such a request is refused)")
    generation_config: str = option(
        "auto", "sampling defaults of a request that leaves them out: auto (the model's "
        "generation_config.json; an adapter's own for its requests), vllm (the engine's), or "
        "a folder holding a generation_config.json")
    engine_process: bool = option(True, "run the engine loop in a process of its own, so the "
                                  "HTTP server never shares a GIL with it (--no-engine-process: "
                                  "a thread of the server's)")
    engine_cpus: str | None = option(
        None, "CPUs (e.g. 0-13 or 0,2,4) the engine process and its torch threads run on, the "
        "HTTP server on the others, as vLLM's CPU build binds its threads (default: all CPUs, "
        "shared)")

    def option_name(self, name: str) -> str:
        return "--" + name.replace("_", "-")

    def __post_init__(self) -> None:
        super().__post_init__()  # the engine's options
        if self.model is None and not self.demo:
            raise ValueError("give --model PATH (a local checkpoint directory) or --demo")
        if self.model is not None and self.demo:
            raise ValueError("--model and --demo exclude each other; pass one")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        for name in ("max_upload_mb", "max_request_mb", "adapter_versions_kept"):
            if getattr(self, name) < 1:
                raise ValueError(f"{self.option_name(name)} must be at least 1, got "
                                 f"{getattr(self, name)}")
        for name in ("upload_timeout_s", "body_seconds_per_mb", "health_timeout_s",
                     "tenant_key_cache_s", "demand_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{self.option_name(name)} must be positive, got "
                                 f"{getattr(self, name)}")
        if self.metrics_max_adapters < 0:
            raise ValueError(f"--metrics-max-adapters must be at least 0, got "
                             f"{self.metrics_max_adapters}")
        if not 0 <= self.replica_tokens_per_s < float("inf"):
            raise ValueError(f"--replica-tokens-per-s must be at least 0 (0: measured), got "
                             f"{self.replica_tokens_per_s}")
        if self.max_waiting < 0:
            raise ValueError(f"--max-waiting must be at least 0, got {self.max_waiting}")
        if self.tensor_parallel_size > 1 and not self.engine_process:
            raise ValueError("--tensor-parallel-size > 1 runs the engine in a process of its "
                             "own: drop --no-engine-process")
        if self.engine_cpus is not None:
            if not self.engine_process:
                raise ValueError("--engine-cpus pins the engine process: drop "
                                 "--no-engine-process")
            self.engine_cpu_set()  # well-formed, and CPUs this process may use
        if self.adapter_store_url is not None and not self.adapter_store_url.startswith("s3://"):
            raise ValueError(f"--adapter-store-url must be s3://BUCKET[/PREFIX], got "
                             f"{self.adapter_store_url!r}")
        if self.otlp_traces_endpoint is not None and not self.otlp_traces_endpoint.startswith(
                ("http://", "https://")):
            raise ValueError(f"--otlp-traces-endpoint must be an http:// or https:// URL (OTLP "
                             f"over HTTP), got {self.otlp_traces_endpoint!r}")
        for name in ("api_key", "admin_key", "metrics_key"):
            if getattr(self, name) == "":
                raise ValueError(f"{self.option_name(name)} is empty; give a key or leave the "
                                 "flag out")
        self.adapter_sources()  # NAME=SOURCE well-formed
        self.chat_template_kwargs()  # a JSON object
        for flag, name, known in (("--reasoning-parser", self.reasoning_parser,
                                   ("auto", "none", *REASONING_PARSERS)),
                                  ("--tool-call-parser", self.tool_call_parser,
                                   ("auto", *TOOL_CALL_PARSERS))):
            if name not in known:
                raise ValueError(f"{flag} {name!r} is not one of: {', '.join(known)}")

    def chat_template_kwargs(self) -> dict:
        """--default-chat-template-kwargs, parsed."""
        if self.default_chat_template_kwargs is None:
            return {}
        try:
            kwargs = json.loads(self.default_chat_template_kwargs)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--default-chat-template-kwargs is not JSON: {exc}") from None
        if not isinstance(kwargs, dict):
            raise ValueError("--default-chat-template-kwargs must be a JSON object")
        return kwargs

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

    def engine_cpu_set(self) -> frozenset[int] | None:
        """--engine-cpus as a set of CPU ids, each one this process may run on."""
        if self.engine_cpus is None:
            return None
        cpus = parse_cpu_list(self.engine_cpus)
        allowed = os.sched_getaffinity(0)
        if not cpus <= allowed:
            raise ValueError(f"--engine-cpus {self.engine_cpus!r} names CPUs "
                             f"{sorted(cpus - allowed)} this process may not use; it may use "
                             f"{sorted(allowed)}")
        return cpus

    def check_model_dir(self) -> None:
        """A --model that is no directory fails before a port is bound; what is inside it is
        the engine's to read (its Ready says what the server needs)."""
        assert self.model is not None, "resolve --demo into a model path before starting"
        if not os.path.isdir(self.model):
            raise ValueError(f"--model {self.model!r} is not a directory; give a local "
                             "checkpoint directory (config.json, safetensors, tokenizer)")

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
    def adapter_path(self) -> str:
        """--adapter-dir, ~ expanded (the adapter store; tenant keys without Redis beside it)."""
        return os.path.expanduser(self.adapter_dir or DEFAULT_ADAPTER_DIR)

    @property
    def replica(self) -> str:
        """This replica's id in the registry: --replica-id, else the host name."""
        return self.replica_id or socket.gethostname()

    @property
    def reachable_url(self) -> str:
        """Where other replicas reach this one: --advertise-url, else --host and --port."""
        return (self.advertise_url or f"http://{self.host}:{self.port}").rstrip("/")

    @property
    def max_capacity(self) -> int:
        """Sequences the gateway admits at once (running plus queued) before answering 429."""
        return self.max_num_seqs + self.max_waiting

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        return cls(**options_from(args, cls))


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every `loragw serve` flag, defaults read from LORAGW_<FLAG> now."""
    return add_options(parser, ServerConfig)


def parse_cpu_list(text: str) -> frozenset[int]:
    """A Linux CPU list ("0-3,8,10-11") as a set of CPU ids."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, sep, last = part.strip().partition("-")
        try:
            lo, hi = int(first), int(last) if sep else int(first)
        except ValueError:
            raise ValueError(f"--engine-cpus {text!r} is not a CPU list; e.g. 0-13 or 0,2,4") \
                from None
        if lo < 0 or hi < lo:
            raise ValueError(f"--engine-cpus {text!r}: {part.strip()!r} is not a CPU range")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)
