"""HTTP/1.1 requests written by hand on a socket, for what httpx will not send: a body that
stalls halfway, a Content-Length the body never meets, chunks that run past a server's limit.

    with RawRequest(server.url, "POST", "/v1/completions",
                    {"Content-Type": "application/json", "Transfer-Encoding": "chunked"}) as r:
        r.send_chunk(b" " * 65536)
        status, error = r.response()
"""

from __future__ import annotations

import http.client
import json
import socket
from urllib.parse import urlsplit


class RawRequest:
    """The request line and headers go out at once; the body, piece by piece, as the test says."""

    def __init__(self, url: str, method: str, path: str, headers: dict[str, str],
                 timeout: float = 30.0):
        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
        lines = [f"{method} {path} HTTP/1.1", f"Host: {parts.netloc}",
                 *(f"{name}: {value}" for name, value in headers.items()), "", ""]
        self.sock.sendall("\r\n".join(lines).encode("latin-1"))

    def send(self, data: bytes) -> bool:
        """Write body bytes; False once the server has stopped reading (it answered early) or
        this side has closed the socket (the test read the answer meanwhile)."""
        try:
            self.sock.sendall(data)
            return True
        except OSError:  # broken pipe, reset, or a closed descriptor (EBADF)
            return False

    def send_chunk(self, data: bytes) -> bool:
        """One chunk of a `Transfer-Encoding: chunked` body."""
        return self.send(b"%x\r\n%s\r\n" % (len(data), data))

    def response(self) -> tuple[int, dict]:
        """The server's answer (waiting at most the socket's timeout): status and JSON body."""
        reply = http.client.HTTPResponse(self.sock)
        reply.begin()
        return reply.status, json.loads(reply.read())

    def __enter__(self) -> RawRequest:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()
