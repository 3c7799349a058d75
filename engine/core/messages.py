"""What crosses between a server and its engine process: msgspec Structs, MessagePack on the
wire, one frame per message (multiprocessing.connection's length-prefixed frames).

    to the engine       Submit (requests, all or none), Abort, Call (an engine method by
                        name, see process.CALLS), Stop
    from the engine     Ready (EngineInfo), Outputs (everything one step produced, for every
                        stream at once), Failed (a step failed these requests), Reply (to a
                        Submit or Call: a value, or the error it raised)

Errors cross as ErrorInfo and are raised again on the server side as the same kind of
ValueError (InvalidParam keeps its param and code, an AdapterError its HTTP status).
"""

from __future__ import annotations

from typing import Any

import msgspec

from adapters import errors as adapter_errors
from engine.sampling_params import InvalidParam
from engine.sequence import EngineRequest, RequestOutput
from engine.snapshot import EngineInfo


class Submit(msgspec.Struct, tag=True):
    call: int
    requests: list[EngineRequest]


class Abort(msgspec.Struct, tag=True):
    request_id: str


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
    fatal: bool = False  # the engine process exits next (a tensor-parallel rank is gone)


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


ToEngine = Submit | Abort | Call | Stop
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


def raise_error(info: ErrorInfo) -> None:
    if info.kind == "InvalidParam":
        raise InvalidParam(info.param or "", info.message, info.code)
    kind = {k.__name__: k for k in _KINDS}.get(info.kind, RuntimeError)
    exc = kind(info.message)
    if info.status is not None and isinstance(exc, adapter_errors.AdapterError):
        exc.status = info.status  # a subclass's own status (400 for an invalid id, ...)
    raise exc
