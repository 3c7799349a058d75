"""Cold-start breakdown of one adapter (rank 16 on every target): Hub -> disk (a loopback Hub)
and object store -> disk (a loopback S3 server: moto, as in the fleet tests; sha256-verified,
then written to the disk store as a replica does), disk -> host (parse + validate), host ->
device (slot fill), and the time to first token of a request for a cold adapter vs a resident
one. Prints a markdown table.

    .venv/bin/python benchmarks/bench_cold_start.py [--out /tmp/bench-cold]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save
from tqdm import tqdm

from loragw.adapters.format import read_adapter
from loragw.adapters.hub import fetch_hub_adapter
from loragw.adapters.object_store import ObjectStore
from loragw.adapters.store import AdapterStore
from loragw.adapters.store_meta import StoredMeta
from loragw.engine.config import Config
from loragw.engine.llm_engine import LLMEngine
from loragw.engine.request.params import SamplingParams

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests" / "adapters")]  # the tests' loopback servers
from common import build_random_llama  # noqa: E402
from hub_server import HubServer  # noqa: E402
from s3_server import S3Server  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK = 16


def peft_bytes(hf: dict, rank: int = RANK) -> dict[str, bytes]:
    """A rank-`rank` PEFT adapter on every projection of the model described by `hf`."""
    h, inter = hf["hidden_size"], hf["intermediate_size"]
    head_dim = hf.get("head_dim") or h // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * head_dim, hf["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    tensors = {}
    for layer in range(hf["num_hidden_layers"]):
        for t in TARGETS:
            block = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            out_f, in_f = shapes[t]
            key = f"base_model.model.model.layers.{layer}.{block}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank) * 0.01
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(TARGETS), "bias": "none"}
    return {"adapter_config.json": json.dumps(config).encode(),
            "adapter_model.safetensors": save(tensors)}


def ttft(llm: LLMEngine, adapter: str) -> float:
    started = time.perf_counter()
    llm.add_request([5, 6, 7, 8], SamplingParams(max_tokens=1, temperature=0.0), adapter)
    while not llm.step():
        pass
    while llm.has_unfinished():
        llm.step()
    return time.perf_counter() - started


def s3_to_disk(store: ObjectStore, files: dict[str, bytes], disk: AdapterStore,
               repeats: int = 5) -> float:
    """Median seconds of what a replica does on first use: fetch both objects, verify their
    sha256 against the catalog's, write the adapter to its disk store."""
    config, weights = files["adapter_config.json"], files["adapter_model.safetensors"]
    key = store.put(config, weights)
    sha, config_sha = hashlib.sha256(weights).hexdigest(), hashlib.sha256(config).hexdigest()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        config_raw, weights_raw = store.get(key, sha, config_sha)
        disk.put("from-s3", config_raw, weights_raw, StoredMeta("upload"), replace=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(name: str, model_dir: str, work: str, store: ObjectStore) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    files = peft_bytes(hf)
    size_mb = len(files["adapter_model.safetensors"]) / 1e6
    s3_s = s3_to_disk(store, files, AdapterStore(os.path.join(work, name, "disk")))
    llm = LLMEngine(Config(model=model_dir, device="cpu", max_loras=2, max_lora_rank=RANK,
                           max_model_len=256))
    with HubServer({"bench/cold": {"main": files}}) as hub:
        t0 = time.perf_counter()
        fetched = fetch_hub_adapter("bench/cold", endpoint=hub.endpoint,
                                    cache_dir=os.path.join(work, name, "hf"))
        hub_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    adapter = read_adapter(fetched.path, llm.lora.spec)
    host_s = time.perf_counter() - t0
    llm.add_adapter("cold", fetched.path, adapter)
    t0 = time.perf_counter()
    llm.to_device("cold")
    device_s = time.perf_counter() - t0
    ttft(llm, None)  # warm the model
    llm.add_adapter("cold2", fetched.path, adapter)
    llm.evict_adapter("cold2")  # disk tier: the engine re-reads it on first use
    cold_s = ttft(llm, "cold2")
    resident_s = min(ttft(llm, "cold") for _ in range(3))
    misses = tier_misses(llm, fetched.path, adapter)
    return dict(name=name, mb=size_mb, hub=hub_s, s3=s3_s, host=host_s, device=device_s,
                cold=cold_s, resident=resident_s, **misses)


def tier_misses(llm: LLMEngine, path: str, adapter, repeats: int = 21) -> dict:
    """Median TTFT of a request whose adapter is in host memory (a slot fill on its way) and of
    one whose adapter is on disk (a read and parse first), each less the resident TTFT of the
    same adapter measured right after it, against the bare copy of the adapter's bytes: host -> host memcpy of its
    tensors, and a read of its safetensors file (from the page cache, as a replica reads a file
    it wrote)."""
    tensors = [m.lora_a for m in adapter.modules.values()] + [
        m.lora_b for m in adapter.modules.values()]
    weights = os.path.join(path, "adapter_model.safetensors")

    def bare_copy() -> float:
        t0 = time.perf_counter()
        for x in tensors:
            torch.empty_like(x).copy_(x)
        return time.perf_counter() - t0

    def bare_read() -> float:
        t0 = time.perf_counter()
        with open(weights, "rb") as f:
            f.read()
        return time.perf_counter() - t0

    host, disk, resident = [], [], []
    for i in range(repeats):  # each miss less the resident TTFT measured right after it
        llm.add_adapter(f"h{i}", path, adapter)  # host memory, no slot
        host.append(ttft(llm, f"h{i}") - ttft(llm, f"h{i}"))
        llm.add_adapter(f"d{i}", path, adapter)
        llm.evict_adapter(f"d{i}")  # disk
        disk.append(ttft(llm, f"d{i}"))
        resident.append(ttft(llm, f"d{i}"))
        disk[-1] -= resident[-1]
        for name in (f"h{i}", f"d{i}"):
            llm.remove_adapter(name)
    base = statistics.median(resident)
    return dict(host_miss=statistics.median(host), disk_miss=statistics.median(disk),
                copy=statistics.median(bare_copy() for _ in range(repeats)),
                read=statistics.median(bare_read() for _ in range(repeats)), base=base)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "bench-cold"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from loragw.demo.model import build_demo_model

    models = {"demo": build_demo_model(os.path.join(args.out, "demo")),
              "llama-25M": build_random_llama(os.path.join(args.out, "llama25m"))}
    s3 = S3Server()
    s3.start()
    try:
        os.environ.update(s3.env)  # the store reads the standard AWS variables
        store = ObjectStore(f"s3://{s3.create_bucket()}/bench")
        rows = [measure(name, path, args.out, store)
                for name, path in tqdm(models.items(), desc="models")]
    finally:
        s3.stop()
    print("| model | adapter MB | Hub→disk ms (MB/s) | S3→disk ms (MB/s; ms/MB) | disk→host ms "
          "(MB/s) | host→device ms (MB/s) | TTFT cold ms | TTFT resident ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cell = lambda k, r=r: f"{r[k] * 1e3:.1f} ({r['mb'] / r[k]:.0f})"
        s3_cell = f"{r['s3'] * 1e3:.1f} ({r['mb'] / r['s3']:.0f}; {r['s3'] * 1e3 / r['mb']:.1f})"
        print(f"| {r['name']} | {r['mb']:.2f} | {cell('hub')} | {s3_cell} | {cell('host')} | "
              f"{cell('device')} | {r['cold'] * 1e3:.1f} | {r['resident'] * 1e3:.1f} |")
    print("\n| model | TTFT resident ms | host miss: + ms (bare memcpy ms, multiple) | disk miss: "
          "+ ms (bare file read ms, multiple) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['base'] * 1e3:.1f} | {r['host_miss'] * 1e3:.1f} "
              f"({r['copy'] * 1e3:.2f}, {r['host_miss'] / r['copy']:.1f}x) | "
              f"{r['disk_miss'] * 1e3:.1f} ({r['read'] * 1e3:.2f}, "
              f"{r['disk_miss'] / r['read']:.1f}x) |")


if __name__ == "__main__":
    main()
