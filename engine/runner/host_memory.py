"""Freed host memory kept for the next step instead of handed back to the OS.

glibc serves every allocation above its mmap threshold (which adapts up to 32 MiB) with fresh
pages and unmaps them when the tensor is freed, so on the CPU a decode step's large transient
tensors (each layer's K/V gather, the logits) are page-faulted in anew at every step: a 64 MiB
gather takes 16 ms that way and 2 ms in memory the process kept (benchmarks/RESULTS.md,
"The decode step at the roofline"). vLLM's CPU build gets the same from tcmalloc, preloaded.
`keep_freed_memory` raises the mmap and trim thresholds once, in the process that runs the
model on the CPU: allocations up to MMAP_BYTES come from the heap, and up to TRIM_BYTES freed at
the top of a heap stay with the process (larger tensors still go straight to the OS).
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)
MMAP_BYTES = 256 << 20
TRIM_BYTES = 512 << 20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_freed_memory() -> bool:
    """True if glibc took the thresholds (False elsewhere: musl, macOS)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)
                    and libc.mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
    except (OSError, AttributeError) as exc:
        logger.debug("mallopt unavailable: %s", exc)
        return False
