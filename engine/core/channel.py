"""The byte channel between a server and its engine process: length-prefixed frames over one
Unix socket pair, each frame written whole or not at all and read whole, whatever its size.

    frame = length (8 bytes, little-endian) + payload (one MessagePack message)

`ServerChannel` is the server's end. Its socket is non-blocking (the event loop watches it),
so a frame larger than the socket buffer goes out in pieces: frames wait in an outgoing queue
and the loop writes them as the engine drains the socket (add_writer), never a half frame
followed by another frame's bytes. Reads are reassembled the same way (`FrameReader`). Callers
get no backpressure of their own: every frame sent is a request whose reply they await, and
admission bounds how many requests and how large each one is, so the queue stays bounded.

`EngineChannel` is the engine's end: a blocking socket, so `send` returns once the whole frame
is in the socket (the engine waits for a slow server rather than tearing a frame), while
`receive` takes only what has arrived (MSG_DONTWAIT) and keeps a partial frame for later, so a
large request arriving in pieces never holds up a step.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import socket
import struct
import threading
from collections.abc import Callable

HEADER = struct.Struct("<Q")  # the payload's length
READ_CHUNK = 1 << 20
# No message comes near this; a length past it means the stream is not frames (a bug): the
# channel is closed rather than waiting forever for bytes that will never come.
MAX_FRAME = 1 << 34


class ChannelClosed(EOFError):
    """The other end closed the socket (or it carries something that is not frames)."""


class FrameReader:
    """Bytes in, whole frames out: `feed(data)` returns the payloads `data` completed."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._need: int | None = None  # the current frame's payload length, once its header is in

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        frames = []
        start = 0
        while True:
            if self._need is None:
                if len(self._buf) - start < HEADER.size:
                    break
                (self._need,) = HEADER.unpack_from(self._buf, start)
                if self._need > MAX_FRAME:
                    raise ChannelClosed(f"a frame header says {self._need} bytes: the stream is "
                                        "not frames")
                start += HEADER.size
            if len(self._buf) - start < self._need:
                break
            frames.append(bytes(self._buf[start:start + self._need]))
            start += self._need
            self._need = None
        del self._buf[:start]
        return frames


def frame_parts(payload: bytes) -> tuple[bytes, bytes]:
    return HEADER.pack(len(payload)), payload


class ServerChannel:
    """The server's end, on `loop`: `on_frame(payload)` for each frame that arrives and
    `on_closed()` once when the engine's end closes. `send` may be called from any thread."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop,
                 on_frame: Callable[[bytes], None], on_closed: Callable[[], None]):
        sock.setblocking(False)
        self.sock, self.loop = sock, loop
        self.on_frame, self.on_closed = on_frame, on_closed
        self.reader = FrameReader()
        self.closed = False  # close() was called
        self._broken = False  # a write failed: the engine's end is gone (its EOF follows)
        self._out: collections.deque[memoryview] = collections.deque()  # whole frames' parts
        self._lock = threading.Lock()  # senders on other threads (a second front end's loop)
        self._writing = False  # a writer callback is armed on the loop
        loop.add_reader(sock.fileno(), self._readable)

    @property
    def buffered(self) -> int:
        """Bytes queued and not yet in the socket."""
        with self._lock:
            return sum(len(part) for part in self._out)

    def send(self, payload: bytes) -> None:
        """Queue one frame (all of it: the engine sees it whole or, if it dies, not at all) and
        write what the socket takes now. ChannelClosed once the engine's end is gone."""
        with self._lock:
            if self.closed or self._broken:
                raise ChannelClosed("the engine's end of the channel is closed")
            self._out.extend(memoryview(part) for part in frame_parts(payload))
            if self._writing:
                return  # the armed writer keeps the order
            self._flush_locked()
            if self._out:
                self._writing = True
                if _on_thread_of(self.loop):
                    self.loop.add_writer(self.sock.fileno(), self._writable)
                else:
                    self.loop.call_soon_threadsafe(self.loop.add_writer, self.sock.fileno(),
                                                   self._writable)

    def _flush_locked(self) -> None:
        while self._out:
            try:
                sent = self.sock.sendmsg(list(itertools.islice(self._out, 64)))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # the engine's end is gone: the reader sees its EOF
                self._out.clear()
                self._broken = True
                return
            while sent:
                head = self._out[0]
                if sent >= len(head):
                    sent -= len(head)
                    self._out.popleft()
                else:
                    self._out[0] = head[sent:]
                    sent = 0

    def _writable(self) -> None:
        with self._lock:
            self._flush_locked()
            if not self._out:
                self._writing = False
                self.loop.remove_writer(self.sock.fileno())

    def _readable(self) -> None:
        while not self.closed:
            try:
                data = self.sock.recv(READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            try:
                frames = self.reader.feed(data) if data else None
            except ChannelClosed:
                frames = None
            if frames is None:
                self.close()
                self.on_closed()
                return
            for payload in frames:
                self.on_frame(payload)

    def close(self) -> None:
        """Stop watching the socket and close it; queued frames are dropped."""
        with self._lock:
            if self.sock.fileno() < 0:
                return
            self.closed = True
            self._out.clear()
            self.loop.remove_reader(self.sock.fileno())
            if self._writing:
                self.loop.remove_writer(self.sock.fileno())
                self._writing = False
            self.sock.close()


class EngineChannel:
    """The engine's end: blocking whole-frame sends, non-blocking reads."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(True)
        self.sock = sock
        self.reader = FrameReader()

    def fileno(self) -> int:  # for select / multiprocessing.connection.wait
        return self.sock.fileno()

    def send(self, payload: bytes) -> None:
        header, body = frame_parts(payload)
        self.sock.sendall(header)
        self.sock.sendall(body)

    def receive(self) -> list[bytes]:
        """The frames completed by what has arrived (none if nothing has); ChannelClosed once
        the server's end is closed."""
        frames: list[bytes] = []
        while True:
            try:
                data = self.sock.recv(READ_CHUNK, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return frames
            except OSError as exc:
                raise ChannelClosed(str(exc)) from None
            if not data:
                if frames:
                    return frames  # deliver these; the EOF reads again next time
                raise ChannelClosed("the server closed the channel")
            frames += self.reader.feed(data)

    def receive_one(self) -> bytes:
        """Block until one whole frame has arrived (the config, before the loop starts)."""
        while True:
            frames = self.reader.feed(self._recv_blocking())
            if frames:
                assert len(frames) == 1, "the server sends nothing before the engine is Ready"
                return frames[0]

    def _recv_blocking(self) -> bytes:
        data = self.sock.recv(READ_CHUNK)
        if not data:
            raise ChannelClosed("the server closed the channel")
        return data


def _on_thread_of(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
