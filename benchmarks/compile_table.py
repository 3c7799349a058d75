"""Registers, spills and shared memory of every Triton kernel binary the engine can launch,
compiled for sm_80 and sm_90 on the CPU (no GPU): a summary per kernel family, and the full
table (one row per variant, both targets side by side) in benchmarks/compile_targets.md.

    python benchmarks/compile_table.py [--cold] [--summary FILE] [--full FILE] [--workers N]

The variants are kernels/compile_targets.py's, compiled by kernels/aot_compile.py (the same as
tests/kernels/test_compile_targets.py, and the same cache: reruns are fast). --cold compiles
into a fresh temporary cache, so the time reported is a full compile.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from loragw.kernels.aot_compile import (
    TARGETS,
    Resources,
    compile_all,
    default_cache_dir,
    problems,
    targets_for,
)
from loragw.kernels.compile_targets import Variant, all_variants

logger = logging.getLogger("compile_table")
Results = dict[tuple[Variant, str], Resources]


def _spills(res: Resources) -> str:
    return "-" if res.error else ("0" if not (res.stack or res.local)
                                  else f"{res.stack}+{res.local} B")


def _span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def summary(variants: list[Variant], results: Results) -> list[str]:
    """One row per kernel family and target: register range, worst spill, largest shared."""
    limits = {t.name: t.max_shared for t in TARGETS}
    groups: dict[tuple[str, str], list[tuple[Variant, Resources]]] = defaultdict(list)
    for v in variants:
        for t in targets_for(v):
            groups[v.family, t.name].append((v, results[v, t.name]))
    lines = ["| kernel family | target | variants | registers | spills (max stack+local / thread)"
             " | max shared bytes (% of limit) | warps | stages |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for (family, target), rows in groups.items():
        ok = [r for _, r in rows if not r.error]
        worst = max(ok, key=lambda r: r.stack + r.local)
        shared = max(r.shared for r in ok)
        lines.append(f"| {family} | {target} | {len(rows)} | {_span([r.registers for r in ok])}"
                     f" | {_spills(worst)} | {shared} ({100 * shared / limits[target]:.0f}%) | "
                     f"{_span([r.num_warps for r in ok])} | {_span([r.num_stages for r in ok])} |")
    return lines


def full_table(variants: list[Variant], results: Results) -> list[str]:
    """One row per variant: registers / spills / shared bytes on each target."""
    head = " | ".join(f"{t.name} registers | {t.name} spills | {t.name} shared B" for t in TARGETS)
    lines = [f"| variant | {head} | warps | stages |",
             "|---|" + "---:|" * (3 * len(TARGETS) + 2)]
    for v in variants:
        cells, res = [], None
        for t in TARGETS:
            if t not in targets_for(v):  # below the variant's min_capability: not compiled
                cells += [f"needs sm_{v.min_capability}", "-", "-"]
                continue
            res = results[v, t.name]
            cells += (["error", "-", "-"] if res.error
                      else [str(res.registers), _spills(res), str(res.shared)])
        lines.append(f"| {v.label} | {' | '.join(cells)} | {res.num_warps} | {res.num_stages} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold", action="store_true", help="compile into a fresh cache (timed)")
    parser.add_argument("--workers", type=int, help="compile processes (default: one per core)")
    parser.add_argument("--summary", metavar="PATH", help="also write the summary block here")
    parser.add_argument("--full", metavar="PATH",
                        default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                             "compile_targets.md"),
                        help="the full table (default: benchmarks/compile_targets.md)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import triton
    from tqdm import tqdm

    variants = all_variants()
    with tempfile.TemporaryDirectory(prefix="loragw-aot-cold-") as cold:
        cache = Path(cold) if args.cold else default_cache_dir()
        start = time.perf_counter()
        total = sum(len(targets_for(v)) for v in variants)
        with tqdm(total=total, desc="compile (variant, target)") as bar:
            results = compile_all(variants, TARGETS, cache, args.workers, progress=bar.update)
        seconds = time.perf_counter() - start
    found = problems(results)
    binaries = len({r.binary for r in results.values() if not r.error})
    lines = [f"machine: {os.cpu_count()}-core CPU, no GPU; Triton {triton.__version__} "
             f"(ptxas and cuobjdump from its wheel)",
             "command: python benchmarks/compile_table.py " + " ".join(sys.argv[1:]),
             f"{len(variants)} variants x up to {len(TARGETS)} targets = {len(results)} compiles, "
             f"{binaries} distinct cubins, in {seconds:.0f} s "
             f"({'cold: empty cache' if args.cold else 'from the cache where present'}, "
             f"{args.workers or os.cpu_count()} workers); problems: {len(found) or 'none'}",
             "", *summary(variants, results)]
    lines += ["", *found] if found else []
    text = "\n".join(lines) + "\n"
    logger.info("%s", text)
    if args.summary:
        Path(args.summary).write_text(text)
    Path(args.full).write_text(
        "# Triton kernel variants compiled for sm_80 / sm_90 (no GPU)\n\n"
        "Written by `python benchmarks/compile_table.py`; the summary is in RESULTS.md. Spills: "
        "stack + local bytes per thread. Shared: Triton's dynamic allocation plus the cubin's "
        "static shared memory. Per-step arguments (token and slot counts, table width, split "
        "counts, the packed metadata pointers) are never specialized, so each row serves every "
        "step.\n\n" + text + "\n" + "\n".join(full_table(variants, results)) + "\n")


if __name__ == "__main__":
    main()
