"""What crosses between a server and its engine loop: msgspec Structs. On a thread of the
server's they cross as they are; to an engine process as MessagePack, one frame each
(engine/core/channel.py).

    to the engine       Submit (requests, all or none), Abort, AddAdapter (a parsed adapter,
                        or the directory to read one from), Call (one of EngineLoop's calls by
                        name), Stop
    from the engine     Ready (EngineInfo), Outputs (everything one step produced, for every
                        stream at once), Failed (a step failed these requests), Reply (to a
                        Submit, AddAdapter or Call: a value, or the error it raised)

Errors cross as ErrorInfo and are raised again on the server side as the same kind of
ValueError (InvalidParam keeps its param and code, an AdapterError its HTTP status).
"""

from __future__ import annotations

from typing import Any

import msgspec

from loragw.adapters import errors as adapter_errors
from loragw.engine.request.params import InvalidParam
from loragw.engine.request.sequence import EngineRequest, RequestOutput
from loragw.engine.snapshot import EngineInfo


class Submit(msgspec.Struct, tag=True):
    call: int
    requests: list[EngineRequest]


class Abort(msgspec.Struct, tag=True):
    request_id: str


class AddAdapter(msgspec.Struct, tag=True):
    """Register or replace `name`. `adapter`: the adapter parsed and validated where its bytes
    were read (a LoraAdapter on a thread, its adapters.wire packing across processes), or None
    to read and parse it from `path` (the disk tier) on the engine's loader thread."""

    call: int
    name: str
    path: str | None
    adapter: Any = None
    catalog_version: int | None = None  # what logs name it (the engine counts its own)


class Call(msgspec.Struct, tag=True):
    call: int
    method: str
    args: list[Any] = []


class Stop(msgspec.Struct, tag=True):
    pass


class Ready(msgspec.Struct, tag=True):
    info: EngineInfo


class Outputs(msgspec.Struct, tag=True):
    items: list[RequestOutput]


class Failed(msgspec.Struct, tag=True):
    request_ids: list[str]
    message: str
    fatal: bool = False  # the engine loop ends next (a tensor-parallel rank is gone)


class ErrorInfo(msgspec.Struct):
    kind: str  # the exception's class name
    message: str
    param: str | None = None
    code: str | None = None
    status: int | None = None  # an AdapterError's HTTP status


class Reply(msgspec.Struct, tag=True):
    call: int
    value: Any = None
    error: ErrorInfo | None = None


ToEngine = Submit | Abort | AddAdapter | Call | Stop
FromEngine = Ready | Outputs | Failed | Reply

encode = msgspec.msgpack.Encoder().encode
decode_to_engine = msgspec.msgpack.Decoder(ToEngine).decode
decode_from_engine = msgspec.msgpack.Decoder(FromEngine).decode

# The errors an engine call raises on purpose, most specific first; anything else is a bug
# there and crosses as a RuntimeError.
_KINDS: tuple[type[Exception], ...] = (InvalidParam, adapter_errors.AdapterNotFound,
                                       adapter_errors.AdapterError, ValueError)


def error_info(exc: BaseException) -> ErrorInfo:
    kind = next((k for k in _KINDS if isinstance(exc, k)), RuntimeError)
    message = str(exc) if kind is not RuntimeError else f"{type(exc).__name__}: {exc}"
    return ErrorInfo(kind.__name__, message, getattr(exc, "param", None),
                     getattr(exc, "code", None), getattr(exc, "status", None))


def as_error(info: ErrorInfo) -> Exception:
    """The exception `info` describes, to raise on the server side."""
    if info.kind == "InvalidParam":
        return InvalidParam(info.param or "", info.message, info.code)
    kind = {k.__name__: k for k in _KINDS}.get(info.kind, RuntimeError)
    exc = kind(info.message)
    if isinstance(exc, adapter_errors.AdapterError):  # a subclass's own (400 invalid id, ...)
        exc.status = info.status if info.status is not None else exc.status
        exc.code = info.code or exc.code
    return exc
