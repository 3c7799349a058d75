"""Compile kernel variants (kernels/compile_targets.py) for a GPU target without a GPU, and read
what each binary costs: registers, spills, shared memory.

    results = compile_all(variants, TARGETS, cache_dir)   # {(variant, target name): Resources}
    problems(results)                                      # compile errors, spills, smem > limit

Triton compiles to PTX and ptxas to a cubin on the CPU; `cuobjdump --dump-resource-usage`
(shipped in the Triton wheel) reads registers, stack and local bytes per thread, and static
shared memory; Triton's own (dynamic) shared memory is in the kernel's metadata.

Workers are spawned processes with TRITON_INTERPRET unset: under the interpreter @triton.jit
returns InterpretedFunctions, and triton.language itself is built from them, so a process that
imported Triton that way cannot compile; a fresh one imports the kernels as JITFunctions.
Results are cached as JSON (default_cache_dir(): a per-user temporary directory, never the
repository), keyed by the kernel module's source, the variant, the target and the Triton version;
Triton's own cache goes to a temporary directory removed after each compile_all.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import multiprocessing
import os
import re
import subprocess
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

from loragw.kernels.compile_targets import Variant

KERNEL_MODULES = {"_shrink_kernel": "loragw.kernels.lora_triton", "_expand_kernel": "loragw.kernels.lora_triton",
                  "_decode_kernel": "loragw.kernels.paged_attention",
                  "_reduce_kernel": "loragw.kernels.paged_attention",
                  "_quant_matmul_kernel": "loragw.kernels.quant_triton",
                  "_add_rms_norm_kernel": "loragw.kernels.fused_triton",
                  "_rotary_kernel": "loragw.kernels.fused_triton",
                  "_silu_and_mul_kernel": "loragw.kernels.fused_triton"}


@dataclass(frozen=True)
class Target:
    name: str
    capability: int
    max_shared: int   # bytes per block, opt-in maximum (CUDA guide); checked against static
    #                   (the 1 KB ptxas declares on sm_90 included: conservative) + dynamic


TARGETS = (Target("sm_80", 80, 166912), Target("sm_90", 90, 232448))   # A100, H100/H200
CACHE_FORMAT = 3   # bump when Resources changes: old cache files are then never read


def targets_for(variant: Variant, targets: tuple[Target, ...] = TARGETS) -> tuple[Target, ...]:
    """The targets `variant` is compiled for: those at or above its min_capability."""
    return tuple(t for t in targets if t.capability >= variant.min_capability)


def default_cache_dir() -> Path:
    """Per user, outside the repository; entries are keyed by content, so sharing is safe."""
    return Path(tempfile.gettempdir()) / f"loragw-aot-cache-{os.getuid()}"


@dataclass(frozen=True)
class Resources:
    registers: int        # per thread
    stack: int            # bytes per thread; > 0 in a kernel with no calls means spills
    local: int            # bytes per thread of local memory: spills
    shared_static: int    # bytes, declared in the cubin
    shared_dynamic: int   # bytes, Triton's allocation (metadata.shared), set at launch
    num_warps: int
    num_stages: int
    binary: str = ""      # sha256 of the cubin: equal binaries, equal digests
    error: str = ""       # a compile error's first and last lines; the other fields are 0 then

    @property
    def shared(self) -> int:
        return self.shared_static + self.shared_dynamic


_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resource_usage(cuobjdump: str, cubin: bytes) -> tuple[int, int, int, int]:
    """(registers, stack, static shared, local) of the one kernel in `cubin`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    found = _USAGE.findall(text)
    assert len(found) == 1, f"expected one kernel in cuobjdump's output, got:\n{text}"
    regs, stack, shared, local = map(int, found[0])
    return regs, stack, shared, local


def _init_worker(triton_cache: str) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_CACHE_DIR"] = triton_cache
    # The engine launches with Triton's default (fusion on); so do we, without the notice.
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")


def compile_variant(variant: Variant, target: Target) -> Resources:
    """Compile one variant for `target` in this process (a worker: see the module docstring)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    kernel = getattr(importlib.import_module(KERNEL_MODULES[variant.kernel]), variant.kernel)
    assert isinstance(kernel, JITFunction), (
        f"{variant.kernel} is a {type(kernel).__name__}: compile in a process that imported "
        "Triton without TRITON_INTERPRET=1 (compile_all spawns such workers)")
    names = kernel.arg_names
    assert [n for n, _ in variant.signature] == names, (
        f"{variant.kernel} takes {names}; the variant gives {[n for n, _ in variant.signature]}: "
        "update kernels/compile_targets.py to match the launch site")
    src = triton.compiler.ASTSource(
        fn=kernel, signature=dict(variant.signature),
        constexprs={(names.index(n),): v for n, v in variant.constexprs},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in variant.aligned})
    options = {"num_warps": variant.num_warps}
    if variant.num_stages is not None:
        options["num_stages"] = variant.num_stages
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", target.capability, 32),
                                  options=options)
    except Exception as exc:  # a compile error is a result: the caller reports it
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        where = f"{lines[0]} ... {lines[-1]}" if len(lines) > 1 else "".join(lines)
        return Resources(0, 0, 0, 0, 0, 0, 0, error=f"{type(exc).__name__}: {where}")
    regs, stack, shared, local = resource_usage(triton.knobs.nvidia.cuobjdump.path,
                                                compiled.asm["cubin"])
    meta = compiled.metadata
    return Resources(regs, stack, local, shared, meta.shared, meta.num_warps, meta.num_stages,
                     binary=hashlib.sha256(compiled.asm["cubin"]).hexdigest())


def _compile_task(task: tuple[Variant, Target]) -> Resources:
    return compile_variant(*task)


@cache
def _source_digest(kernel: str) -> str:
    """The kernel's whole module (its source and any global it reads) and Triton's version."""
    import importlib

    import triton

    module = importlib.import_module(KERNEL_MODULES[kernel])
    return hashlib.sha256(inspect.getsource(module).encode() + triton.__version__.encode()).hexdigest()


def cache_key(variant: Variant, target: Target) -> str:
    """Changes with the kernel's module source, the variant, the target or the Triton version."""
    text = json.dumps([CACHE_FORMAT, _source_digest(variant.kernel), repr(variant), asdict(target)])
    return hashlib.sha256(text.encode()).hexdigest()


@contextmanager
def _environ(**values: str | None):
    """os.environ with `values` set (None: removed), restored on exit."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def compile_all(variants: list[Variant], targets: tuple[Target, ...] = TARGETS,
                cache_dir: Path | None = None, workers: int | None = None,
                progress=None) -> dict[tuple[Variant, str], Resources]:
    """Resources of every (variant, target) for target in targets_for(variant, targets), from
    `cache_dir` (default_cache_dir()) where cached, else compiled by `workers` (default: one
    per core) spawned processes. progress(n) is called as results arrive (a tqdm's update)."""
    cache_dir = default_cache_dir() if cache_dir is None else cache_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[Variant, str], Resources] = {}
    todo: list[tuple[Variant, Target, Path]] = []
    for variant in variants:
        for target in targets_for(variant, targets):
            path = cache_dir / f"{cache_key(variant, target)}.json"
            if path.exists():
                results[variant, target.name] = Resources(**json.loads(path.read_text()))
                progress and progress(1)
            else:
                todo.append((variant, target, path))
    if not todo:
        return results
    workers = min(workers or os.cpu_count() or 1, len(todo))
    # Spawned (not forked) workers, started with TRITON_INTERPRET unset: see the docstring.
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="loragw-triton-") as triton_cache, \
            _environ(TRITON_INTERPRET=None, TRITON_CACHE_DIR=triton_cache), \
            ctx.Pool(workers, _init_worker, (triton_cache,)) as pool:
        done = pool.imap(_compile_task, [(v, t) for v, t, _ in todo], chunksize=2)
        for (variant, target, path), res in zip(todo, done):
            part = path.with_suffix(f".{os.getpid()}.part")  # errors too: the key has the source
            part.write_text(json.dumps(asdict(res)))
            part.replace(path)  # atomic: an interrupted run leaves no half-written entry
            results[variant, target.name] = res
            progress and progress(1)
    return results


def problems(results: dict[tuple[Variant, str], Resources],
             targets: tuple[Target, ...] = TARGETS) -> list[str]:
    """A line per compile error, spill (stack or local bytes) or shared memory over the limit."""
    limits = {t.name: t.max_shared for t in targets}
    found = []
    for (variant, target), res in results.items():
        where = f"{target} {variant.label}"
        if res.error:
            found.append(f"{where}: does not compile: {res.error}")
            continue
        if res.stack or res.local:
            found.append(f"{where}: spills (STACK {res.stack} B, LOCAL {res.local} B per thread, "
                         f"{res.registers} registers, {res.num_warps} warps)")
        if res.shared > limits[target]:
            found.append(f"{where}: {res.shared} B of shared memory > {limits[target]} B "
                         f"per block on {target}")
    return found
