"""The CPU kernels written in C (kernels/csrc/*.c), compiled once per machine with the system
C compiler (`cc`, or $CC) at `-O3 -march=native -fopenmp` into a cache directory
($LORAGW_KERNEL_CACHE, else $XDG_CACHE_HOME/loragw/kernels or ~/.cache/loragw/kernels), named
by a hash of the source (and csrc's headers), compiler, flags and this CPU's feature flags (a
cache shared by different CPUs never runs code built for another), and loaded with ctypes.
Their OpenMP is the libgomp torch already loaded, so their threads are torch's. Callers decide
what to do when a library cannot be built (no compiler): each has a torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCES = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
# argument type codes of the declarations below
TYPES = {"p": ctypes.c_void_p, "l": ctypes.c_int64, "i": ctypes.c_int, "f": ctypes.c_float}
# the suffix of a kernel's entry point per dtype it takes (bfloat16 as uint16: csrc/bf16.h)
SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def cache_dir() -> Path:
    root = os.environ.get("LORAGW_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "loragw" / "kernels"


@functools.cache
def cpu_flags() -> str:
    """This CPU's feature flags as /proc/cpuinfo's `flags` line lists them (avx2, avx512_bf16,
    amx_bf16, ...), read once: the build cache's key, and engine/config.py's `--dtype auto`."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def compiler() -> str:
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise RuntimeError("no C compiler (cc or $CC) to build the CPU kernels")
    return found


def build(name: str, out: Path, flags: tuple[str, ...] = ()) -> None:
    """Compile csrc/<name>.c to `out` with FLAGS, then `flags` (tests build other instruction
    sets: ("-march=x86-64",) is the scalar path); raises with the compiler's error."""
    result = subprocess.run([compiler(), *FLAGS, *flags, str(SOURCES / f"{name}.c"), "-o",
                             str(out), "-lm"], capture_output=True, text=True, timeout=120)
    if result.returncode:
        raise RuntimeError(f"{compiler()} failed on {name}.c: {result.stderr.strip()[-500:]}")


@functools.cache
def library(name: str, flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """csrc/<name>.c built with `flags` (see build) on first use, cached, and loaded; raises
    when it cannot be built."""
    headers = [path.read_bytes() for path in sorted(SOURCES.glob("*.h"))]
    key = hashlib.sha256(b"\0".join([(SOURCES / f"{name}.c").read_bytes(), *headers,
                                     compiler().encode(), " ".join(FLAGS + flags).encode(),
                                     platform.machine().encode(), cpu_flags().encode()]))
    path = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # then one atomic rename
            built = Path(tmp) / path.name
            build(name, built, flags)
            os.replace(built, path)
    return ctypes.CDLL(str(path))


def function(name: str, symbol: str, args: str, returns: str | None = None,
             flags: tuple[str, ...] = ()):
    """`symbol` of library `name` (built with `flags`), declared: args one TYPES code per
    argument."""
    fn = getattr(library(name, flags), symbol)
    fn.argtypes = [TYPES[c] for c in args]
    fn.restype = TYPES[returns] if returns else None
    return fn


def exception_problem(exc: Exception) -> str:
    """A kernel's self-check's problem when building, loading or running the kernel raised: the
    exception's type and first line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
