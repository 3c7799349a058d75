"""`loragw serve` (or `python -P -m loragw.gateway.server`): parse the flags, prepare the demo if asked,
run uvicorn until stopped.

`serve_main(argv)` is what gateway/cli.py calls. `BackgroundServer` runs the same app on a
loopback socket in a thread, for tests and benchmarks.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import logging.handlers
import os
import queue
import socket
import sys
import threading
import time
from dataclasses import replace

import httpx
import prometheus_client
import uvicorn

from loragw.demo import DEMO_DIR
from loragw.demo.examples import demo_examples
from loragw.gateway.app import create_app
from loragw.gateway.common.config import ServerConfig, add_serve_arguments

logger = logging.getLogger("loragw.gateway")
GRACEFUL_SHUTDOWN_S = 10
SWITCH_INTERVAL_S = 0.0005


def serve_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="loragw serve", description="Serve a base model and its LoRA adapters behind an "
        "OpenAI-compatible API. Every flag also reads LORAGW_<FLAG> from the environment.")
    add_serve_arguments(parser)
    ns = parser.parse_args(argv)
    configure_logging()
    try:
        config = ServerConfig.from_args(ns)
        if config.demo:
            config = prepare_demo(config)
            names = [spec.split("=", 1)[0] for spec in config.adapter]
            sys.stdout.write(demo_examples(config.host, config.port, config.model_name, names))
            sys.stdout.flush()
        config.check_model_dir()
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    return run_server(config)


def configure_logging(level: int = logging.INFO) -> None:
    """Log lines are queued and written by a listener thread: a write from the event loop is
    a syscall, and getting the GIL back from the busy engine thread after it costs more than
    the log line itself."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log_queue: queue.SimpleQueue = queue.SimpleQueue()
    listener = logging.handlers.QueueListener(log_queue, handler)
    listener.start()
    atexit.register(listener.stop)
    root.addHandler(logging.handlers.QueueHandler(log_queue))
    root.setLevel(level)


def prepare_demo(config: ServerConfig) -> ServerConfig:
    """--demo: the demo model and adapters (built on first use), as --model and --adapter."""
    from loragw.demo.adapters import build_demo_adapters
    from loragw.demo.model import build_demo_model

    root = os.path.expanduser(DEMO_DIR)
    logger.info("preparing the demo model and adapters in %s (built once, then reused)", root)
    model = build_demo_model(root)
    adapters = build_demo_adapters(model, root)
    return replace(config, demo=False, model=model,
                   served_model_name=config.served_model_name or "demo",
                   adapter=tuple(f"{n}={p}" for n, p in adapters.items()) + config.adapter)


def run_server(config: ServerConfig) -> int:
    failures: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_fatal(exc: BaseException) -> None:
        failures.append(exc)
        if server is not None:
            server.should_exit = True

    prometheus_client.disable_created_metrics()  # no *_created series beside every counter
    # The event loop shares the GIL with the engine thread; after each syscall it waits up to
    # one switch interval (5 ms by default) to get it back. A shorter interval keeps HTTP
    # latency low at the price of more thread switches in the engine.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    app = create_app(config, on_fatal=on_fatal)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, lifespan="on", log_config=None,
        access_log=False, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    logger.info("lora-gateway: serving %r on http://%s:%d (OpenAI API under /v1)",
                config.model_name, config.host, config.port)
    server.run()
    return 1 if failures else 0


class BackgroundServer:
    """The app served by uvicorn on 127.0.0.1:<free port> in a daemon thread.

        with BackgroundServer(create_app(config)) as server:
            httpx.get(server.url + "/health")
    """

    def __init__(self, app, host: str = "127.0.0.1"):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(
            app, lifespan="on", log_config=None, access_log=False, timeout_graceful_shutdown=2,
            timeout_keep_alive=30))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="uvicorn", daemon=True)

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited during start-up")
            threading.Event().wait(0.01)
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> BackgroundServer:
        """Block until /ready answers 200 (the model and start-up adapters are loaded)."""
        deadline = time.monotonic() + timeout_s
        while httpx.get(self.url + "/ready").status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server at {self.url} was not ready in {timeout_s:.0f} s")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


if __name__ == "__main__":  # python -P -m loragw.gateway.server --demo
    sys.exit(serve_main())
