"""Residency under load: 3 device slots, 10 adapters, concurrent requests; eviction frees host
memory for real; two managers on one real Redis see each other and a delete crosses over."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

import httpx
import pytest
from redis_server import redis_server  # noqa: F401 (fixture)
from uploads import read_files

from loragw.engine.config import Config
from loragw.engine.core.client import EngineClient
from loragw.engine.llm_engine import LLMEngine
from loragw.engine.request.params import SamplingParams
from loragw.gateway.app import create_app
from loragw.gateway.common.config import ServerConfig
from loragw.gateway.observe.metrics import Metrics
from loragw.gateway.residency.manager import AdapterManager
from loragw.gateway.server import BackgroundServer

NUM = 10
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def slot_server(model_dir, tmp_path_factory):
    # The engine on a thread of the server's: the eviction test follows the tensors themselves.
    config = ServerConfig(model=model_dir, served_model_name="demo-base", device="cpu",
                          max_model_len=256, max_num_seqs=16, max_loras=3,
                          adapter_dir=str(tmp_path_factory.mktemp("res-store")),
                          engine_process=False)
    app = create_app(config)
    with BackgroundServer(app) as background:
        background.services = app.state.services
        background.wait_ready()
        yield background


async def test_three_slots_ten_adapters_each_request_gets_its_own(slot_server, offline,
                                                                  make_adapter, tmp_path,
                                                                  wait_idle):
    names = [f"res-{i}" for i in range(NUM)]
    for i, name in enumerate(names):
        folder = make_adapter(tmp_path / name, 500 + i)
        async with httpx.AsyncClient(base_url=slot_server.url) as c:
            files = {"adapter_config": ("c", read_files(folder)[0]),
                     "adapter_model": ("m", read_files(folder)[1])}
            r = await c.post("/admin/adapters", data={"adapter_id": name}, files=files)
            assert r.status_code == 201, r.text
        offline.add_adapter(name, folder)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = {n: offline.generate([PROMPT], params, adapters=[n])[0].text for n in names}
    assert len(set(want.values())) == NUM
    order = [names[(i * 7) % NUM] for i in range(40)]
    body = {"prompt": PROMPT, "temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=slot_server.url, timeout=120) as c:
        replies = await asyncio.gather(*(c.post("/v1/completions", json=body | {"model": n})
                                         for n in order))
    for name, r in zip(order, replies, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want[name], name
    lora = slot_server.services.engine.transport.engine.lora
    assert lora.stats.device_evictions > 0  # slots really turned over
    wait_idle(slot_server.services)
    for name in names:
        offline.remove_adapter(name)


async def test_evict_frees_host_memory(slot_server, make_adapter, tmp_path, wait_idle):
    folder = make_adapter(tmp_path / "gc", 900)
    async with httpx.AsyncClient(base_url=slot_server.url, timeout=60) as c:
        files = {"adapter_config": ("c", read_files(folder)[0]),
                 "adapter_model": ("m", read_files(folder)[1])}
        assert (await c.post("/admin/adapters", data={"adapter_id": "gc-me"},
                             files=files)).status_code == 201
        assert (await c.post("/admin/adapters/gc-me/load")).json()["residency"] == "device"
        wait_idle(slot_server.services)
        lora = slot_server.services.engine.transport.engine.lora  # the LLMEngine the engine thread steps
        host = lora.adapters["gc-me"].host
        tensor = weakref.ref(next(iter(host.modules.values())).lora_a)
        del host
        before = lora.host_bytes
        r = await c.post("/admin/adapters/gc-me/evict")
        assert r.json()["residency"] == "disk"
        gc.collect()
        assert lora.host_bytes < before
        assert tensor() is None, "the evicted adapter's tensors are still referenced"
        assert (await c.delete("/admin/adapters/gc-me")).status_code == 200


async def test_two_replicas_on_one_redis(model_dir, make_adapter, tmp_path, redis_server):  # noqa: F811
    managers = []
    for i in range(2):
        llm = LLMEngine(Config(model=model_dir, device="cpu", max_model_len=128, max_loras=2))
        config = ServerConfig(model=model_dir, adapter_dir=str(tmp_path / f"store{i}"),
                              redis_url=redis_server.url, replica_id=f"r{i}",
                              served_model_name="demo-base")
        m = AdapterManager(config, EngineClient.on_thread(llm), Metrics())
        await m.start()
        managers.append(m)
    a, b = managers
    try:
        # a path both can read: registered on a, in b's catalog at once, loaded from the path
        await a.register("shared", str(make_adapter(tmp_path / "shared", 42)))
        deadline = time.monotonic() + 5
        while "shared" not in b.records:
            assert time.monotonic() < deadline, "the registration never reached the other replica"
            await asyncio.sleep(0.05)
        await a.load("shared")
        await b.load("shared")
        replicas = {s.replica_id: s for s in await a.registry.replicas()}
        assert set(replicas) == {"r0", "r1"} and "shared" in replicas["r1"].resident
        await a.delete("shared")
        deadline = time.monotonic() + 5
        while "shared" in b.records:
            assert time.monotonic() < deadline, "the delete never reached the other replica"
            await asyncio.sleep(0.05)
        assert "shared" not in b.engine.transport.engine.lora.adapters
        await b.publish()
        replicas = {s.replica_id: s for s in await a.registry.replicas()}
        assert "shared" not in replicas["r1"].resident
    finally:
        for m in managers:
            await m.close()
            await asyncio.to_thread(m.engine.shutdown)
