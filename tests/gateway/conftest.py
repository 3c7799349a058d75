"""One live gateway for the whole directory: the demo base model plus eight random PEFT
adapters, served by uvicorn on a loopback port with --max-loras 4, and the offline engine on
the same model and adapters as the reference its outputs must equal."""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import openai
import pytest
from random_adapters import (
    ADAPTERS,
    BASE,
    MAX_LORAS,
    MAX_MODEL_LEN,
    write_random_adapter,
)

from loragw.adapters.format import read_adapter
from loragw.engine import LLM
from loragw.engine.models import adapter_spec
from loragw.gateway.app import create_app
from loragw.gateway.common.config import ServerConfig
from loragw.gateway.server import BackgroundServer


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    from loragw.demo.model import build_demo_model

    return build_demo_model(str(tmp_path_factory.mktemp("gateway-demo")))


@pytest.fixture(scope="session")
def hf_config(model_dir) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def adapter_dirs(model_dir, hf_config, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gateway-adapters")
    spec = adapter_spec(hf_config, max_lora_rank=16)
    paths = {}
    for i, name in enumerate(ADAPTERS):
        paths[name] = write_random_adapter(str(root / name), hf_config, seed=100 + i)
        read_adapter(paths[name], spec)  # a valid PEFT adapter for this base model
    return paths


@pytest.fixture(scope="session")
def server_config(model_dir, adapter_dirs, tmp_path_factory) -> ServerConfig:
    # Its own adapter store: the default (~/.cache/lora-gateway/adapters) is shared with
    # `make demo` and every other run on the machine.
    return ServerConfig(model=model_dir, served_model_name=BASE, device="cpu",
                        adapter_dir=str(tmp_path_factory.mktemp("adapter-store")),
                        max_model_len=MAX_MODEL_LEN, max_num_seqs=32, max_loras=MAX_LORAS,
                        adapter=tuple(f"{n}={p}" for n, p in adapter_dirs.items()))


@pytest.fixture(scope="session")
def server(server_config):
    """The live server; `server.services` is its Services (engine counters for assertions)."""
    app = create_app(server_config)
    with BackgroundServer(app) as background:
        background.services = app.state.services
        background.wait_ready()
        yield background


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def offline(model_dir, adapter_dirs) -> LLM:
    """The offline engine with the server's model, context and adapters: the reference."""
    llm = LLM(model_dir, device="cpu", max_model_len=MAX_MODEL_LEN, max_loras=MAX_LORAS)
    for name, path in adapter_dirs.items():
        llm.add_adapter(name, path)
    return llm


@pytest.fixture(scope="session")
def base_name() -> str:
    return BASE


@pytest.fixture(scope="session")
def adapter_names() -> list[str]:
    return list(ADAPTERS)


@pytest.fixture(scope="session")
def make_adapter(hf_config):
    """make_adapter(dir, seed, **options) writes a random PEFT adapter for the demo model
    (options: write_random_adapter's rank, targets, ...); returns dir."""
    return lambda out_dir, seed, **options: write_random_adapter(str(out_dir), hf_config, seed,
                                                                 **options)


@pytest.fixture(scope="session")
def wait_idle():
    """wait_idle(services): until no sequence, KV block, slot or admitted request is held."""
    return _wait_idle


@pytest.fixture(scope="session")
def engine_state():
    """engine_state(services): the engine's EngineSnapshot now, from a thread outside the
    server's event loop (the engine may be in a process of its own)."""
    return _engine_state


def _engine_state(services):
    return asyncio.run_coroutine_threadsafe(services.snapshot(), services.loop).result(30)


def engine_idle(services) -> bool:
    snap = _engine_state(services)
    return (snap.num_running == 0 and snap.num_waiting == 0
            and snap.kv_blocks_free == snap.kv_blocks_total and snap.slots_in_use == 0
            and services.capacity.inflight == 0)


def _wait_idle(services, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not engine_idle(services):
        assert time.monotonic() < deadline, "sequences, KV blocks or slots still held"
        time.sleep(0.02)
