"""Command-line flags from dataclass fields; every flag also reads LORAGW_<FLAG>.

A config dataclass declares each option once, as a field made by `engine.config.option`
(default, help, and optionally `choices`, `off` (the flag value that stands for None) or
`flag` (another flag name)); `add_options(parser, Cls)` turns its fields into flags and
`options_from(args, Cls)` turns parsed flags back into keyword arguments for `Cls`.

Precedence: the command line, then the environment, then the field's default. An environment
variable's value becomes the flag's default when the parser is built (an invalid one is a
usage error naming the variable); an empty one counts as unset. Lists are comma-separated in
the environment and may be comma-separated or repeated on the command line; a list given on
the command line replaces the variable's. Booleans read 1/true/yes/on or 0/false/no/off, and
`--x` has a `--no-x`.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from dataclasses import MISSING, Field, fields
from typing import Any

ENV_PREFIX = "LORAGW_"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# A field's annotation (a string: the modules use `from __future__ import annotations`) -> the
# kind of its flag.
_KINDS = {"str": str, "int": int, "float": float, "bool": bool, "tuple[str, ...]": list}


def env_var(flag: str) -> str:
    """`--max-lora-rank` (or `max_lora_rank`) -> `LORAGW_MAX_LORA_RANK`."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def parse_bool(text: str) -> bool:
    """The one reading of a true/false word; ValueError names what it accepts."""
    lowered = text.strip().lower()
    if lowered not in TRUE + FALSE:
        raise ValueError(f"expected one of {', '.join(TRUE + FALSE)}, got {text!r}")
    return lowered in TRUE


def parse_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse(kind: type, text: str) -> Any:
    if kind is bool:
        return parse_bool(text)
    if kind is list:
        return parse_list(text)
    if kind is float:
        return math.inf if text.strip().lower() in ("inf", "infinity") else float(text)
    return kind(text)


class _ListAction(argparse.Action):
    """Repeatable, comma-separated; the first use on the command line replaces the default."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest, None)
        fresh = current is self.default or current is None
        setattr(namespace, self.dest, ([] if fresh else list(current)) + parse_list(values))


def add_flag(parser: argparse.ArgumentParser, flag: str, *, kind: type = str,
             default: Any = None, help: str = "", choices: tuple | None = None,
             metavar: str | None = None, environ: Mapping[str, str] | None = None) -> None:
    """One flag, its default read from LORAGW_<FLAG> when that is set."""
    environ = os.environ if environ is None else environ
    name = env_var(flag)
    raw = environ.get(name, "")
    if raw.strip():
        try:
            default = parse(kind, raw)
        except ValueError as exc:
            parser.error(f"environment variable {name}={raw!r} is invalid: {exc}")
        if choices is not None and default not in choices:
            parser.error(f"{name}={raw!r}: expected one of {', '.join(map(str, choices))}")
    shown = "" if default in (None, (), []) else f"; default {default}"
    kwargs: dict[str, Any] = {"help": f"{help} [env {name}{shown}]", "default": default}
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif kind is list:
        kwargs.update(action=_ListAction,
                      metavar=metavar or flag.lstrip("-").upper().replace("-", "_"))
        kwargs["default"] = list(default or ())
    else:
        kwargs.update(type=kind, choices=choices, metavar=metavar)
    parser.add_argument(flag, **kwargs)


def option_fields(cls: type) -> list[Field]:
    """The fields of a config dataclass that are command-line options (they have help): its
    own first, then those it inherits (the server's flags before the engine's)."""
    own = cls.__dict__.get("__annotations__", {})
    options = [f for f in fields(cls) if "help" in f.metadata]
    return sorted(options, key=lambda f: f.name not in own)


def flag_of(f: Field) -> str:
    return "--" + f.metadata.get("flag", f.name).replace("_", "-")


def add_options(parser: argparse.ArgumentParser, cls: type,
                environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    for f in option_fields(cls):
        kind = _KINDS[str(f.type).replace(" | None", "")]
        default = None if f.default is MISSING else f.default
        if "off" in f.metadata and default is None:
            default = f.metadata["off"]
        add_flag(parser, flag_of(f), kind=kind, default=default, help=f.metadata["help"],
                 choices=f.metadata.get("choices"), environ=environ)
    return parser


def options_from(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """Keyword arguments for `cls` from parsed flags (lists become tuples; `off` -> None)."""
    values = {}
    for f in option_fields(cls):
        value = getattr(args, flag_of(f)[2:].replace("-", "_"))
        if "off" in f.metadata and value == f.metadata["off"]:
            value = None
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return values
