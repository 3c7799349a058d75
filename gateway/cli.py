"""`loragw`: the command line. One function per subcommand, `cmd_<name>(args) -> exit status`.

Every flag also reads an environment variable, LORAGW_<FLAG> (`--out` -> LORAGW_OUT,
`--log-level` -> LORAGW_LOG_LEVEL); a flag on the command line wins over the variable.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

logger = logging.getLogger(__name__)

DEFAULT_DEMO_DIR = os.path.join("~", ".cache", "lora-gateway", "demo")
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def env_var(flag: str) -> str:
    """`--max-lora-rank` -> `LORAGW_MAX_LORA_RANK`."""
    return "LORAGW_" + flag.lstrip("-").upper().replace("-", "_")


def add_flag(parser: argparse.ArgumentParser, flag: str, **kwargs) -> argparse.Action:
    """parser.add_argument(flag, ...) with its default taken from LORAGW_<FLAG> when that is set.
    `store_true` and `--x/--no-x` flags read 1/true/yes/on or 0/false/no/off; `append` flags
    read a comma-separated list, and flags given on the command line are added to it."""
    name = env_var(flag)
    value = os.environ.get(name)
    action = kwargs.get("action")
    if value is not None:
        if action in ("store_true", argparse.BooleanOptionalAction):
            if value.strip().lower() not in TRUE + FALSE:
                parser.error(f"{name}={value!r}: expected one of {', '.join(TRUE + FALSE[:-1])}")
            kwargs["default"] = value.strip().lower() in TRUE
        elif action == "append":
            kwargs["default"] = [item.strip() for item in value.split(",") if item.strip()]
        else:
            choices = kwargs.get("choices")
            if choices is not None and kwargs.get("type", str)(value) not in choices:
                parser.error(f"{name}={value!r}: expected one of {', '.join(map(str, choices))}")
            kwargs["default"] = value  # argparse applies `type` to string defaults
    kwargs["help"] = f"{kwargs.get('help', '')} [env {name}]".strip()
    return parser.add_argument(flag, **kwargs)


def cmd_demo(args: argparse.Namespace) -> int:
    """Builds the demo base model and the demo adapters (idempotent) and prints their paths."""
    from adapters.demo import build_demo_adapters
    from engine.demo import build_demo_model

    model = build_demo_model(args.out, seed=args.seed)
    logger.info("demo model: %s", model)
    adapters = build_demo_adapters(model, args.out, seed=args.seed)
    for name, path in adapters.items():
        logger.info("demo adapter %s: %s", name, path)
    # The output is the product here: one `model PATH` line, then `adapter NAME=PATH` lines,
    # in the form `loragw serve --adapter` takes.
    sys.stdout.write(f"model {model}\n")
    sys.stdout.writelines(f"adapter {name}={path}\n" for name, path in adapters.items())
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from gateway.server import serve_main

    return serve_main(args.serve_argv)


def cmd_bench(args: argparse.Namespace) -> int:
    from gateway.bench import BenchConfig, bench_main

    adapters = tuple(a.strip() for a in (args.adapters or "").split(",") if a.strip())
    try:
        config = BenchConfig(
            url=args.url, model=args.model, demo=args.demo, adapter=tuple(args.adapter),
            num_requests=args.num_requests, concurrency=args.concurrency,
            request_rate=args.request_rate, adapters=adapters,
            adapter_distribution=args.adapter_distribution, max_tokens=args.max_tokens,
            prompt=args.prompt, endpoint=args.endpoint, stream=args.stream,
            ignore_eos=args.ignore_eos, api_key=args.api_key or None, seed=args.seed,
            json_path=args.json)
    except ValueError as exc:
        sys.stderr.write(f"loragw bench: {exc}\n")
        return 2
    return bench_main(config)


def add_demo_parser(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="build the demo base model and demo adapters")
    add_flag(parser, "--out", default=DEFAULT_DEMO_DIR,
             help=f"directory for model/ and adapters/ (default {DEFAULT_DEMO_DIR})")
    add_flag(parser, "--seed", type=int, default=0, help="seed for weights and training")
    parser.set_defaults(command=cmd_demo)


def add_serve_parser(subparsers) -> None:
    # The serve flags live with the server (gateway/config.py); `loragw serve --help` shows them.
    parser = subparsers.add_parser("serve", help="serve the OpenAI-compatible API", add_help=False)
    parser.set_defaults(command=cmd_serve)


def add_bench_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="serving benchmark against a running server or one started for it",
        description="Streams requests to the OpenAI API and reports TTFT, TPOT, end-to-end "
        "latency and throughput, as vLLM's `vllm bench serve`. Exit status 1 if any failed.")
    add_flag(parser, "--url", help="base URL of a running server, e.g. http://127.0.0.1:8000")
    add_flag(parser, "--model", help="without --url: start `loragw serve --model PATH`")
    add_flag(parser, "--demo", action="store_true", help="without --url: start `loragw serve "
             "--demo`")
    add_flag(parser, "--adapter", action="append", default=[], metavar="NAME=SOURCE",
             help="adapter the started server registers (repeatable)")
    add_flag(parser, "--num-requests", type=int, default=64, help="requests to send")
    add_flag(parser, "--concurrency", type=int, default=8, help="requests in flight at most")
    add_flag(parser, "--request-rate", type=float, default=float("inf"),
             help="mean Poisson arrivals per second (inf: all at once)")
    add_flag(parser, "--adapters", metavar="ID,ID,...",
             help="model ids to spread requests over; 'all': every adapter in GET /v1/models "
                  "(default: the base model)")
    add_flag(parser, "--adapter-distribution", default="uniform", choices=("uniform", "zipf"),
             help="uniform: round-robin; zipf: the k-th id with weight 1/k")
    add_flag(parser, "--max-tokens", type=int, default=32, help="max_tokens of each request")
    add_flag(parser, "--ignore-eos", action="store_true",
             help="generate max_tokens even past end-of-sequence (vLLM extension)")
    add_flag(parser, "--prompt", help="the prompt of every request (default: a built-in set)")
    add_flag(parser, "--endpoint", default="completions", choices=("completions", "chat"),
             help="/v1/completions or /v1/chat/completions")
    add_flag(parser, "--stream", action=argparse.BooleanOptionalAction, default=True,
             help="stream responses, on by default (--no-stream: whole responses, so no TTFT "
                  "or TPOT)")
    add_flag(parser, "--api-key", help="Bearer key for /v1/* (and of the started server)")
    add_flag(parser, "--seed", type=int, default=0, help="seed for arrivals and zipf draws")
    add_flag(parser, "--json", metavar="PATH", help="also write the results as JSON")
    parser.set_defaults(command=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loragw", description="lora-gateway: one base model, many LoRA adapters, one API.")
    add_flag(parser, "--log-level", default="INFO",
             choices=("DEBUG", "INFO", "WARNING", "ERROR"), type=str.upper, help="logging level")
    subparsers = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")
    for add in (add_serve_parser, add_demo_parser, add_bench_parser):
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "serve":  # everything after `serve` belongs to the server's parser
        return cmd_serve(argparse.Namespace(serve_argv=argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.command(args)


if __name__ == "__main__":
    sys.exit(main())
