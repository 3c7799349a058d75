"""Slowloris: a body dripping at one byte a second, JSON or an adapter upload, is cut off with a
408 once past its deadline (--upload-timeout-s plus --body-seconds-per-mb per MB received),
on a front end of the live gateway with --upload-timeout-s 1; a body sent at once still works."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest
from random_adapters import BASE
from raw_http import RawRequest

from loragw.gateway.app import create_app
from loragw.gateway.server import BackgroundServer

KEY = "deadline-admin-key"
GRACE_S = 1.0
JSON_BODY = b'{"model": "' + BASE.encode() + b'", "prompt": "hi", "max_tokens": 1}' + b" " * 64


@pytest.fixture(scope="module")
def deadline_server(server):
    config = replace(server.services.config, upload_timeout_s=GRACE_S, admin_key=KEY)
    with BackgroundServer(create_app(config, services=server.services)) as background:
        yield background


def _drip(url: str, path: str, content_type: str, body: bytes) -> tuple[int, dict, float]:
    """Send `body` a byte a second until the server answers: its status, error and the time."""
    headers = {"Content-Type": content_type, "Content-Length": str(len(body)),
               "Authorization": f"Bearer {KEY}"}
    with RawRequest(url, "POST", path, headers, timeout=30) as request:
        answered = threading.Event()

        def drip():
            for byte in body:
                if answered.is_set() or not request.send(bytes([byte])):
                    return
                time.sleep(1.0)

        dripping = threading.Thread(target=drip, daemon=True)
        started = time.monotonic()
        dripping.start()
        try:
            status, error = request.response()
        finally:
            answered.set()
        return status, error, time.monotonic() - started


def test_a_body_dripping_a_byte_a_second_is_cut_off_with_408(deadline_server):
    boundary = "deadline-boundary"
    upload = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"adapter_id\"\r\n\r\n"
              f"dripped\r\n--{boundary}--\r\n").encode() + b" " * 64
    drips = [("/v1/completions", "application/json", JSON_BODY)] * 4 + \
            [("/admin/adapters", f"multipart/form-data; boundary={boundary}", upload)] * 4
    with ThreadPoolExecutor(len(drips)) as pool:
        results = list(pool.map(lambda d: _drip(deadline_server.url, *d), drips))
    for (path, _, _), (status, error, took) in zip(drips, results, strict=True):
        print(f"{path}: {status} after {took:.2f} s")
        assert status == 408, (path, error)
        assert error["error"]["code"] == "request_timeout"
        # an upload's pause rule (no gap of --upload-timeout-s) may fire first: both name the flag
        assert "--upload-timeout-s" in error["error"]["message"], error
        # the deadline is GRACE_S plus 30 s/MB of a few bytes: well under the 64 s the drip takes
        assert GRACE_S * 0.8 < took < GRACE_S + 8, (path, took)
    with httpx.Client(base_url=deadline_server.url, timeout=60) as c:
        r = c.post("/v1/completions", content=JSON_BODY,
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text
