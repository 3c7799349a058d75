"""The engine in a process of its own (vLLM V1's engine core): a server keeps its event loop
and the engine its step loop, with no GIL between them. process.py is the engine's side,
client.py the server's (the same interface as engine.async_engine.AsyncEngine, which runs
the engine on a thread instead), messages.py what crosses between them."""

import os


def pin_threads(cpus: set[int] | frozenset[int]) -> None:
    """Run every thread of this process, and every thread it starts later, on `cpus`."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
