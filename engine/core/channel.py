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
large request arriving in pieces never holds up a step. Payloads arrive as bytearrays (msgspec
decodes any buffer).
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
# No message comes near this; a length past it means the stream is not frames (a bug): the
# channel is closed rather than waiting forever for bytes that will never come.
MAX_FRAME = 1 << 34


class ChannelClosed(EOFError):
    """The other end closed the socket (or it carries something that is not frames)."""


class FrameReader:
    """Whole frames from a socket, read in place: each frame's bytes land in a buffer of its
    own size (recv_into), so a large frame is copied once, by the kernel; a frame still
    arriving is kept for the next read."""

    def __init__(self) -> None:
        self._header = bytearray(HEADER.size)
        self._body: bytearray | None = None  # the frame being read, once its header is in
        self._filled = 0  # bytes of the header, or of the body, read so far

    def read(self, sock: socket.socket, flags: int = 0, one: bool = False) -> list[bytearray]:
        """The frames completed by what `sock` holds now (reading until it would block, or
        after the first with `one`); ChannelClosed at the end of the stream."""
        frames: list[bytearray] = []
        while not (one and frames):
            buffer = self._header if self._body is None else self._body
            if self._filled < len(buffer):
                try:
                    n = sock.recv_into(memoryview(buffer)[self._filled:], 0, flags)
                except (BlockingIOError, InterruptedError):
                    return frames
                except OSError as exc:
                    raise ChannelClosed(str(exc)) from None
                if n == 0:
                    if frames:
                        return frames  # deliver these; the end reads again next time
                    raise ChannelClosed("the other end closed the channel")
                self._filled += n
                if self._filled < len(buffer):
                    continue
            if self._body is None:
                (size,) = HEADER.unpack(self._header)
                if size > MAX_FRAME:
                    raise ChannelClosed(f"a frame header says {size} bytes: the stream is not "
                                        "frames")
                self._body, self._filled = bytearray(size), 0
            else:
                frames.append(self._body)
                self._body, self._filled = None, 0
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
        try:
            frames = self.reader.read(self.sock)
        except ChannelClosed:
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

    def receive(self) -> list[bytearray]:
        """The frames completed by what has arrived (none if nothing has); ChannelClosed once
        the server's end is closed."""
        return self.reader.read(self.sock, socket.MSG_DONTWAIT)

    def receive_one(self) -> bytearray:
        """Block until one whole frame has arrived (the config, before the loop starts)."""
        (frame,) = self.reader.read(self.sock, one=True)
        return frame


def _on_thread_of(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
