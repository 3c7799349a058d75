"""engine/core/channel.py: frames cross the server-engine socket whole, whatever their size and
however slowly the other end reads, from the loop's thread and from others at once; a torn
stream would show here as a frame whose bytes are not its own."""

from __future__ import annotations

import asyncio
import hashlib
import random
import socket
import threading
import time

import pytest

from loragw.engine.core.channel import (
    HEADER,
    ChannelClosed,
    EngineChannel,
    FrameReader,
    ServerChannel,
)


def payload(sender: int, index: int, size: int) -> bytes:
    """A frame that says who sent it, which one it is, and checks its own bytes."""
    body = random.Random(sender * 1000 + index).randbytes(size)
    return f"{sender}:{index}:".encode() + hashlib.sha256(body).digest() + body


def check(frame: bytes) -> tuple[int, int]:
    sender, index, rest = frame.split(b":", 2)
    digest, body = rest[:32], rest[32:]
    assert hashlib.sha256(body).digest() == digest, "a frame holds another frame's bytes"
    return int(sender), int(index)


def test_the_reader_reassembles_frames_split_anywhere():
    """Bytes arrive in pieces of any size, a frame's header split too; each read hands over
    the frames completed so far and keeps the rest."""
    frames = [payload(0, i, size) for i, size in enumerate((0, 1, 7, 4096, 70_000))]
    stream = b"".join(HEADER.pack(len(f)) + f for f in frames)
    ours, theirs = socket.socketpair()
    reader, got, at, rng = FrameReader(), [], 0, random.Random(0)
    while at < len(stream):
        step = rng.choice((1, 3, 8, 1000, 50_000))
        ours.sendall(stream[at:at + step])
        at += step
        got += reader.read(theirs, socket.MSG_DONTWAIT)
    assert got == frames
    ours.close()
    with pytest.raises(ChannelClosed):
        reader.read(theirs, socket.MSG_DONTWAIT)


def test_a_header_that_is_no_frame_closes_the_channel():
    ours, theirs = socket.socketpair()
    ours.sendall(HEADER.pack(1 << 40))
    with pytest.raises(ChannelClosed, match="not frames"):
        FrameReader().read(theirs, socket.MSG_DONTWAIT)


async def test_frames_larger_than_the_socket_buffer_arrive_whole_past_a_slow_reader():
    ours, theirs = socket.socketpair()
    engine_end = EngineChannel(theirs)
    loop = asyncio.get_running_loop()
    channel = ServerChannel(ours, loop, on_frame=lambda _: None, on_closed=lambda: None)
    sizes = [0, 10, 300_000, 2_000_000, 5, 1_000_000, 64_000, 3]  # past ~200 KB of buffer
    received: list[bytes] = []

    def slow_engine() -> None:  # reads in bursts with pauses: the server's queue backs up
        while len(received) < 3 * len(sizes):
            time.sleep(0.02)
            received.extend(engine_end.receive())

    reader = threading.Thread(target=slow_engine)
    reader.start()

    def other_thread(sender: int) -> None:  # a second front end's loop sends from its thread
        for i, size in enumerate(sizes):
            channel.send(payload(sender, i, size))

    senders = [threading.Thread(target=other_thread, args=(s,)) for s in (1, 2)]
    for t in senders:
        t.start()
    for i, size in enumerate(sizes):
        channel.send(payload(0, i, size))
        await asyncio.sleep(0)
    assert channel.buffered > 0, "the test meant to fill the socket buffer"
    while reader.is_alive():
        await asyncio.sleep(0.01)
    for t in senders:
        t.join()
    order: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for frame in received:
        sender, index = check(frame)
        order[sender].append(index)
    assert all(indices == list(range(len(sizes))) for indices in order.values()), order
    assert channel.buffered == 0
    channel.close()
    theirs.close()


async def test_the_server_end_reports_a_closed_engine_end_once_and_refuses_sends():
    ours, theirs = socket.socketpair()
    closed = asyncio.Event()
    frames: list[bytes] = []
    channel = ServerChannel(ours, asyncio.get_running_loop(), frames.append, closed.set)
    engine_end = EngineChannel(theirs)
    engine_end.send(b"last words")
    theirs.close()
    await asyncio.wait_for(closed.wait(), 5)
    assert frames == [b"last words"]
    with pytest.raises(ChannelClosed):
        channel.send(b"anyone there?")
