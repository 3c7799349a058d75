"""A streamed completion held open on one replica of the tenants' fleet (tenant_fleet.py): it
takes a concurrency slot of its key for as long as the test wants, and its client leaves
mid-stream on `close()`. Shared by the test_tenants_fleet* modules that need a slot taken.
"""

from __future__ import annotations

import threading
import time

import httpx
from tenant_fleet import BASE, MODEL_LEN, PROMPT, TenantFleet


class HeldStream(threading.Thread):
    """A streamed completion that lasts seconds, held open (its client reading nothing more)
    until `release` is set; leaving it closes the connection mid-stream."""

    def __init__(self, fleet: TenantFleet, rid: str, by: str):
        super().__init__(daemon=True)
        self.url, self.by = fleet.urls[rid] + "/v1/completions", by
        self.status: int | None = None
        self.response: httpx.Response | None = None
        self.answered, self.release, self.closed = (threading.Event(), threading.Event(),
                                                    threading.Event())

    def run(self) -> None:
        body = {"model": BASE, "prompt": PROMPT, "max_tokens": MODEL_LEN - 64,
                "ignore_eos": True, "stream": True, "temperature": 0}
        try:
            with httpx.Client(timeout=60) as client, client.stream(
                    "POST", self.url, json=body,
                    headers={"Authorization": f"Bearer {self.by}"}) as response:
                self.status, self.response = response.status_code, response
                if response.status_code == 200:
                    # kept: an abandoned line iterator would close the connection
                    self.lines = response.iter_lines()
                    next(line for line in self.lines if line.startswith("data: "))
                else:
                    response.read()
                self.answered.set()
                self.release.wait(60)
        finally:
            self.answered.set()
            self.closed.set()

    def close(self) -> None:
        self.release.set()
        self.closed.wait(30)


def hold(fleet: TenantFleet, rid: str, by: str, tries: int = 10) -> HeldStream:
    """A HeldStream, answered; a refused one is retried (a finished request's slot is given
    back just after its response) up to `tries` times, 0.2 s apart."""
    for _ in range(tries):
        stream = HeldStream(fleet, rid, by)
        stream.start()
        assert stream.answered.wait(60)
        if stream.status == 200:
            return stream
        stream.close()
        time.sleep(0.2)
    return stream
