"""What a tenant key costs a request, against the static --api-key: p50 and p99 of the same
requests made with each key, side by side in one run.

    python benchmarks/bench_tenants.py [--model DIR] [--version-requests 3000]
                                       [--completion-requests 300] [--quick] [--json PATH]

One gateway server (a subprocess, OMP_NUM_THREADS=1) on a redis-server of its own, on loopback.
Through the admin API it mints two member keys of one tenant: one without limits, one with rpm,
tpm and max_concurrency set so high they never refuse (its admission is one Redis round trip, a
Lua script, and its finish another, after the response). Three keys then send:

    GET /version            the guard and a trivial handler: what resolving the key costs
    POST /v1/completions    base model, max_tokens=1, temperature 0: the guard, admission (for
                            the limited key the Lua script) and one engine step

Each round sends one request per key, in a shuffled order, so all three see the same machine
load; each key keeps its own keep-alive connection (a blocking raw socket, so the numbers are
the gateway's and not a Python HTTP client's). Prints a markdown table.

The limited key's admission keeps a running total of its tpm reservations, so its cost does not
grow with the requests that key made in the last minute.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx
import redis
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gateway import percentile  # noqa: E402
from common import demo_model, machine, write_json  # noqa: E402

from loragw.gateway.bench.server import HOST, free_port, stop_server, wait_ready  # noqa: E402

MODEL_NAME = "bench"
API_KEY, ADMIN_KEY, TENANT = "user-key", "op-key", "bench"
HUGE_LIMITS = {"rpm": 10**9, "tpm": 10**12, "max_concurrency": 10**6}  # never refuse
COMPLETION = {"model": MODEL_NAME, "prompt": "Tell me about the ocean", "max_tokens": 1,
              "temperature": 0}
WARMUP = 20  # requests per key and workload before the measured ones


class KeyClient:
    """One keep-alive HTTP/1.1 connection that sends every request with one Bearer key: the
    blocking twin of bench_gateway's RawClient, with GET and an Authorization header (and no
    streaming: every response here has a Content-Length)."""

    def __init__(self, host: str, port: int, key: str):
        self.host, self.key = host, key
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = self.sock.makefile("rb")

    def request(self, method: str, path: str, body: dict | None = None) -> dict[str, str]:
        """Send one request, read its whole response; its headers (lower-cased names)."""
        payload = json.dumps(body).encode() if body is not None else b""
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n"
                f"Authorization: Bearer {self.key}\r\n")
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        self.sock.sendall(head.encode() + b"\r\n" + payload)
        status = int(self.reader.readline().split(b" ", 2)[1])
        headers = {}
        while (line := self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        data = self.reader.read(int(headers.get("content-length", 0)))
        if status != 200:
            raise RuntimeError(f"{method} {path}: HTTP {status}: {data[:300]!r}")
        return headers

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    method: str
    path: str
    body: dict | None
    requests: int  # measured, per key


def start_redis() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", HOST, "--save", "",
                             "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://{HOST}:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    try:
        while True:
            try:
                client.ping()
                return proc, url
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"redis-server on port {port} did not answer in 10 s "
                                       f"(exit status {proc.poll()})") from None
                time.sleep(0.05)
    finally:
        client.close()


def start_gateway(model: str, redis_url: str, adapter_dir: str,
                  log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "loragw.gateway.server", "--model", model, "--device", "cpu",
         "--served-model-name", MODEL_NAME, "--api-key", API_KEY, "--admin-key", ADMIN_KEY,
         "--redis-url", redis_url, "--adapter-dir", adapter_dir, "--max-model-len", "256",
         "--host", HOST, "--port", str(port)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
        env=os.environ | {"OMP_NUM_THREADS": "1"})
    url = f"http://{HOST}:{port}"
    try:
        wait_ready(url, proc, log)
    except BaseException:
        stop_server(proc)
        raise
    return proc, url


def mint(url: str, limits: dict) -> str:
    """A member key of TENANT with `limits`, minted by the operator: its secret."""
    answer = httpx.post(f"{url}/admin/tenants/{TENANT}/keys", json={"role": "member", **limits},
                        headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    answer.raise_for_status()
    return answer.json()["key"]


def run(url: str, keys: dict[str, str], work: Workload, seed: int) -> dict[str, list[float]]:
    """Seconds per request of `work`, per key name; rounds of one request per key, shuffled."""
    port = int(url.rsplit(":", 1)[1])
    clients = {name: KeyClient(HOST, port, key) for name, key in keys.items()}
    order, rng = list(keys), random.Random(seed)
    samples: dict[str, list[float]] = {name: [] for name in keys}
    try:
        for i in tqdm(range(WARMUP + work.requests), desc=work.name, disable=None):
            rng.shuffle(order)
            for name in order:
                started = time.perf_counter()
                clients[name].request(work.method, work.path, work.body)
                if i >= WARMUP:
                    samples[name].append(time.perf_counter() - started)
    finally:
        for client in clients.values():
            client.close()
    return samples


def check_limited(url: str, key: str) -> None:
    """The limited key really goes through the limiter: its responses carry x-ratelimit-*."""
    client = KeyClient(HOST, int(url.rsplit(":", 1)[1]), key)
    try:
        headers = client.request("POST", "/v1/completions", COMPLETION)
    finally:
        client.close()
    assert "x-ratelimit-remaining-requests" in headers, headers


def table(results: dict[str, dict[str, list[float]]], static: str) -> list[str]:
    ms = 1e3
    lines = ["| workload | key | p50 ms | p99 ms | p50 added vs static key (ms) | p99 added |",
             "|---|---|---|---|---|---|"]
    for workload, by_key in results.items():
        base50, base99 = percentile(by_key[static], 0.5), percentile(by_key[static], 0.99)
        for name, values in by_key.items():
            p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
            added = ("-", "-") if name == static else (f"{(p50 - base50) * ms:+.3f}",
                                                       f"{(p99 - base99) * ms:+.3f}")
            lines.append(f"| {workload} | {name} | {p50 * ms:.3f} | {p99 * ms:.3f} | "
                         f"{added[0]} | {added[1]} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model dir (default: the demo model, built if missing)")
    parser.add_argument("--version-requests", type=int, default=3000, help="per key")
    parser.add_argument("--completion-requests", type=int, default=300, help="per key")
    parser.add_argument("--seed", type=int, default=0, help="of the order within each round")
    parser.add_argument("--quick", action="store_true", help="500 / 100 requests per key")
    parser.add_argument("--json", help="write the raw seconds per request here")
    args = parser.parse_args()
    if args.quick:
        args.version_requests, args.completion_requests = 500, 100
    logging.basicConfig(level=logging.WARNING)
    model = demo_model(args.model)
    workloads = [Workload("GET /version", "GET", "/version", None, args.version_requests),
                 Workload("POST /v1/completions (max_tokens=1)", "POST", "/v1/completions",
                          COMPLETION, args.completion_requests)]

    redis_proc = gateway = None
    with tempfile.TemporaryDirectory() as adapter_dir, tempfile.TemporaryFile() as log:
        try:
            redis_proc, redis_url = start_redis()
            gateway, url = start_gateway(model, redis_url, adapter_dir, log)
            keys = {"static --api-key": API_KEY, "tenant key": mint(url, {}),
                    "tenant key with limits": mint(url, HUGE_LIMITS)}
            check_limited(url, keys["tenant key with limits"])
            results = {work.name: run(url, keys, work, args.seed + i)
                       for i, work in enumerate(workloads)}
        finally:
            if gateway is not None:
                stop_server(gateway)
            if redis_proc is not None:
                stop_server(redis_proc)

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\n{machine()} (the client; the server: OMP_NUM_THREADS=1); load average "
          f"{load} at the end")
    print(f"command: python benchmarks/bench_tenants.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"{args.version_requests} GET /version and {args.completion_requests} completions "
          f"per key, after {WARMUP} warm-up requests per key; rounds interleave the keys\n")
    print("\n".join(table(results, "static --api-key")))
    write_json(args.json, {"machine": machine(), "argv": sys.argv, "seconds": results})


if __name__ == "__main__":
    main()
