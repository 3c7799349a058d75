"""`loragw`: the command line. One function per subcommand, `cmd_<name>(args) -> exit status`.

Every flag also reads an environment variable, LORAGW_<FLAG> (`--out` -> LORAGW_OUT,
`--log-level` -> LORAGW_LOG_LEVEL); a flag on the command line wins over the variable
(gateway/common/flags.py). `loragw serve`'s flags are ServerConfig's fields (gateway/common/config.py),
`loragw bench`'s are BenchConfig's (gateway/bench/config.py).
"""

from __future__ import annotations

import argparse
import logging
import sys

from loragw.demo import DEMO_DIR
from loragw.gateway.common.flags import add_flag, add_options, env_var, options_from

__all__ = ["build_parser", "env_var", "main"]
logger = logging.getLogger(__name__)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def cmd_demo(args: argparse.Namespace) -> int:
    """Builds the demo base model and the demo adapters (idempotent) and prints their paths."""
    from loragw.demo.adapters import build_demo_adapters
    from loragw.demo.model import build_demo_model

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
    from loragw.gateway.server import serve_main

    return serve_main(args.serve_argv)


def cmd_bench(args: argparse.Namespace) -> int:
    from loragw.gateway.bench.client import bench_main
    from loragw.gateway.bench.config import BenchConfig

    try:
        config = BenchConfig(**options_from(args, BenchConfig))
    except ValueError as exc:
        sys.stderr.write(f"loragw bench: {exc}\n")
        return 2
    return bench_main(config)


def add_demo_parser(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="build the demo base model and demo adapters")
    add_flag(parser, "--out", default=DEMO_DIR,
             help="directory for model/ and adapters/")
    add_flag(parser, "--seed", kind=int, default=0, help="seed for weights and training")
    parser.set_defaults(command=cmd_demo)


def add_serve_parser(subparsers) -> None:
    # The serve flags live with the server (gateway/common/config.py); `loragw serve --help` shows them.
    parser = subparsers.add_parser("serve", help="serve the OpenAI-compatible API", add_help=False)
    parser.set_defaults(command=cmd_serve)


def add_bench_parser(subparsers) -> None:
    from loragw.gateway.bench.config import BenchConfig

    parser = subparsers.add_parser(
        "bench", help="serving benchmark against a running server or one started for it",
        description="Streams requests to the OpenAI API and reports TTFT, TPOT, end-to-end "
        "latency and throughput, as vLLM's `vllm bench serve`. Exit status 1 if any failed.")
    add_options(parser, BenchConfig)
    parser.set_defaults(command=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loragw", description="lora-gateway: one base model, many LoRA adapters, one API.")
    add_flag(parser, "--log-level", default="INFO", choices=LOG_LEVELS, kind=str.upper,
             help="logging level")
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
