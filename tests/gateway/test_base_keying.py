"""An adapter belongs to its base model (adapters/base_identity.py, adapters/store_bases.py).

Tried as a new user would: two servers on different bases (the demo Llama and a tiny Qwen2)
share one --adapter-dir and one Redis. An adapter uploaded to one is neither listed nor served
nor forwarded by the other (404 there), the same id can name an adapter of each base, and
adapters an older server left at the top of the adapter dir move into the store of the base
they fit, staying out of the other's.
"""

from __future__ import annotations

import dataclasses
import json
import os

import httpx
import pytest
from checkpoints import make_tiny_checkpoint
from fleet_harness import load_fixture_module
from random_adapters import write_random_adapter
from uploads import read_files

from loragw.adapters.base_identity import base_identity
from loragw.adapters.store import AdapterStore
from loragw.adapters.store_bases import BASES_DIR, open_base_store
from loragw.adapters.store_meta import StoredMeta
from loragw.engine.models import adapter_spec
from loragw.gateway.app import create_app
from loragw.gateway.common.config import ServerConfig
from loragw.gateway.server import BackgroundServer

redis_server = load_fixture_module("redis_server").redis_server  # the fixture
PROMPT = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0.0,
          "ignore_eos": True}


def config_of(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen-base")), "qwen2")


def upload(c: httpx.Client, adapter_id: str, folder: str) -> httpx.Response:
    config, weights = read_files(folder)
    return c.post("/admin/adapters", data={"adapter_id": adapter_id},
                  files={"adapter_config": ("adapter_config.json", config),
                         "adapter_model": ("adapter_model.safetensors", weights)})


def advertised(config: ServerConfig) -> BackgroundServer:
    """A server whose --advertise-url is the loopback port it got (so a forward would work)."""
    app = create_app(config)
    background = BackgroundServer(app)
    app.state.services.config = dataclasses.replace(config, advertise_url=background.url)
    return background


def listed(c: httpx.Client) -> set[str]:
    return {m["id"] for m in c.get("/v1/models").json()["data"]}


def test_the_key_is_what_an_adapter_must_fit(model_dir, hf_config, qwen_dir, tmp_path):
    llama = adapter_spec(hf_config, max_lora_rank=16)
    assert base_identity(llama, "a").key != base_identity(
        adapter_spec(config_of(qwen_dir), max_lora_rank=16), "a").key
    # the path, served name, rank limit and dtype are not part of the fit
    elsewhere = adapter_spec(hf_config, max_lora_rank=64, model_path=tmp_path, dtype="bfloat16")
    assert base_identity(elsewhere, "b").key == base_identity(llama, "a").key
    wider = adapter_spec(hf_config | {"intermediate_size": hf_config["intermediate_size"] * 2},
                         max_lora_rank=16)
    assert base_identity(wider, "a").key != base_identity(llama, "a").key


def test_adapters_an_older_server_left_move_to_the_base_they_fit(
        model_dir, hf_config, qwen_dir, adapter_dirs, tmp_path):
    root = str(tmp_path / "adapters")
    legacy = AdapterStore(root)
    config_raw, weights_raw = read_files(adapter_dirs["lora-0"])
    legacy.put("old-bot", config_raw, weights_raw, StoredMeta("upload", version=3, owner="acme"))
    legacy.close()

    qwen_spec = adapter_spec(config_of(qwen_dir), max_lora_rank=16)
    qwen = open_base_store(root, base_identity(qwen_spec, "qwen"), qwen_spec)
    assert qwen.list() == []  # not Qwen2's: left where it was
    assert os.path.isdir(os.path.join(root, "old-bot"))

    llama_spec = adapter_spec(hf_config, max_lora_rank=16)
    base = base_identity(llama_spec, "demo")
    llama = open_base_store(root, base, llama_spec)
    [moved] = llama.list()
    assert (moved.adapter_id, moved.version, moved.owner, moved.base) == ("old-bot", 3, "acme",
                                                                           base)
    assert moved.path.startswith(os.path.join(os.path.realpath(root), BASES_DIR, base.key))
    assert not os.path.exists(os.path.join(root, "old-bot"))
    assert qwen.list() == []
    for store in (qwen, llama):
        store.close()


def test_two_bases_share_an_adapter_dir_and_a_redis(
        model_dir, qwen_dir, hf_config, adapter_dirs, tmp_path, redis_server):
    shared_dir = str(tmp_path / "adapters")
    common = dict(device="cpu", max_model_len=128, max_loras=2, adapter_dir=shared_dir,
                  redis_url=redis_server.url)
    configs = {"llama": ServerConfig(model=model_dir, served_model_name="demo-base",
                                     replica_id="llama-1", **common),
               "qwen": ServerConfig(model=qwen_dir, served_model_name="qwen-base",
                                    replica_id="qwen-1", **common)}
    qwen_adapter = write_random_adapter(str(tmp_path / "qwen-bot"), config_of(qwen_dir), seed=5)
    with advertised(configs["llama"]) as llama_server, advertised(configs["qwen"]) as qwen_server:
        for background in (llama_server, qwen_server):
            background.wait_ready()
        with httpx.Client(base_url=llama_server.url, timeout=120) as llama, \
                httpx.Client(base_url=qwen_server.url, timeout=120) as qwen:
            assert upload(llama, "bot", adapter_dirs["lora-1"]).status_code == 201
            served = llama.post("/v1/completions", json={"model": "bot", **PROMPT})
            assert served.status_code == 200, served.text
            assert "bot" in listed(llama) and "bot" not in listed(qwen)
            assert qwen.get("/admin/adapters").json()["data"] == []
            # another base's adapter is a 404 here, never a forward to the replica holding it
            refused = qwen.post("/v1/completions", json={"model": "bot", **PROMPT})
            assert refused.status_code == 404, refused.text
            assert "not registered" in refused.json()["error"]["message"] or \
                "does not exist" in refused.json()["error"]["message"]

            # the same id names an adapter of each base; neither disturbs the other
            assert upload(qwen, "bot", qwen_adapter).status_code == 201
            again = llama.post("/v1/completions", json={"model": "bot", **PROMPT})
            assert again.json()["choices"][0]["text"] == served.json()["choices"][0]["text"]
            assert qwen.post("/v1/completions",
                             json={"model": "bot", **PROMPT}).status_code == 200
            infos = {name: c.get("/admin/adapters/bot").json() for name, c in
                     (("llama", llama), ("qwen", qwen))}
            assert infos["llama"]["sha256"] != infos["qwen"]["sha256"]
            assert infos["llama"]["base"].startswith("demo-base (LlamaForCausalLM, base ")
            assert infos["qwen"]["base"].startswith("qwen-base (Qwen2ForCausalLM, base ")

            # a Llama adapter uploaded to the Qwen2 server is refused, naming why
            wrong = upload(qwen, "llama-on-qwen", adapter_dirs["lora-2"])
            assert wrong.status_code == 422 and "different base model" in wrong.text, wrong.text
    # each base's store is its own folder under the shared adapter dir
    assert len(os.listdir(os.path.join(shared_dir, BASES_DIR))) == 2
