"""The CPU kernels written in C (kernels/csrc/*.c), compiled once per machine with the system
C compiler (`cc`, or $CC) at `-O3 -march=native -fopenmp` into a cache directory
($LORAGW_KERNEL_CACHE, else $XDG_CACHE_HOME/loragw/kernels or ~/.cache/loragw/kernels), named
by a hash of the source, compiler, flags and this CPU's feature flags (a cache shared by
different CPUs never runs code built for another), and loaded with ctypes. Their OpenMP is the
libgomp torch already loaded, so their threads are torch's. Callers decide what to do when a
library cannot be built (no compiler): each has a torch path.
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

SOURCES = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
# argument type codes of the declarations below
TYPES = {"p": ctypes.c_void_p, "l": ctypes.c_int64, "i": ctypes.c_int, "f": ctypes.c_float}


def cache_dir() -> Path:
    root = os.environ.get("LORAGW_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "loragw" / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


@functools.cache
def library(name: str) -> ctypes.CDLL:
    """csrc/<name>.c built (on first use) and loaded; raises when it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError(f"no C compiler (cc or $CC) to build the {name} kernel")
    source = SOURCES / f"{name}.c"
    key = hashlib.sha256(b"\0".join([source.read_bytes(), compiler.encode(),
                                     " ".join(FLAGS).encode(), platform.machine().encode(),
                                     _cpu_flags().encode()]))
    path = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # then one atomic rename
            built = Path(tmp) / path.name
            result = subprocess.run([compiler, *FLAGS, str(source), "-o", str(built), "-lm"],
                                    capture_output=True, text=True, timeout=120)
            if result.returncode:
                raise RuntimeError(f"{compiler} failed on {source.name}: "
                                   f"{result.stderr.strip()[-500:]}")
            os.replace(built, path)
    return ctypes.CDLL(str(path))


def function(name: str, symbol: str, args: str, returns: str | None = None):
    """`symbol` of library `name`, declared: args one TYPES code per argument."""
    fn = getattr(library(name), symbol)
    fn.argtypes = [TYPES[c] for c in args]
    fn.restype = TYPES[returns] if returns else None
    return fn


def exception_problem(exc: Exception) -> str:
    """A kernel's self-check's problem when building, loading or running the kernel raised: the
    exception's type and first line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
