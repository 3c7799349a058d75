"""The server-engine channel (engine/core/channel.py) against the socket it runs on: frames of
a given size sent by the server's non-blocking, queueing end (on an event loop) and read whole
by the engine's end (in another process), vs the same bytes through a plain blocking
socket.sendall / recv loop. Reports MB/s for each and their ratio, and how long a frame the size
of a 100,000-token prompt's Submit takes end to end.

    python benchmarks/bench_channel.py [--sizes 4096,300000,4000000] [--total-mb 256]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import select
import socket
import time

from loragw.engine.core.channel import EngineChannel, ServerChannel

ACK = b"k"


def engine_side(fd: int, frames: int, plain: bool) -> None:
    """Read `frames` frames (plain: that many bytes), then say so with one byte."""
    sock = socket.socket(fileno=fd)
    if plain:
        got = 0
        while got < frames:
            got += len(sock.recv(1 << 20))
        sock.sendall(ACK)
        return
    channel, seen = EngineChannel(sock), 0
    while seen < frames:
        select.select([channel], [], [])  # as the engine loop waits for its inbox
        seen += len(channel.receive())
    channel.send(ACK)


def run(size: int, count: int, plain: bool) -> float:
    """Seconds to move `count` frames of `size` bytes to the other process and hear back."""
    ours, theirs = socket.socketpair()
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=engine_side, args=(theirs.fileno(), size * count if plain else count,
                                                 plain))
    proc.start()
    theirs.close()
    payload = os.urandom(size)
    started = time.perf_counter()
    if plain:
        for _ in range(count):
            ours.sendall(payload)
        assert ours.recv(1) == ACK
    else:
        asyncio.run(_send_frames(ours, payload, count))
    elapsed = time.perf_counter() - started
    proc.join()
    ours.close()
    return elapsed


async def _send_frames(sock: socket.socket, payload: bytes, count: int) -> None:
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    channel = ServerChannel(sock, loop, lambda frame: done.set_result(frame),
                            lambda: done.done() or done.set_exception(EOFError()))
    for _ in range(count):
        channel.send(payload)
        await asyncio.sleep(0)  # let the loop write while the engine reads
    assert await done == ACK
    channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,300000,4000000")
    parser.add_argument("--total-mb", type=int, default=256)
    args = parser.parse_args()
    print(f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}; "
          f"{args.total_mb} MB per row\n")
    print("| frame bytes | frames | socket MB/s | channel MB/s | channel / socket | channel ms "
          "per frame |")
    print("|---|---|---|---|---|---|")
    for size in (int(s) for s in args.sizes.split(",")):
        count = max(1, args.total_mb * 2**20 // size)
        plain = min(run(size, count, True) for _ in range(3))
        framed = min(run(size, count, False) for _ in range(3))
        mb = size * count / 2**20
        print(f"| {size:,} | {count:,} | {mb / plain:,.0f} | {mb / framed:,.0f} | "
              f"{plain / framed:.2f} | {framed / count * 1e3:.3f} |")


if __name__ == "__main__":
    main()
