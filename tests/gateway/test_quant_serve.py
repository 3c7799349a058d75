"""`loragw serve` on a quantized base: what the offline engine gives, over HTTP, with an uploaded
adapter; its weight bytes and quantization in /metrics; `--quantization` that contradicts the
checkpoint refused at start, named, before the engine starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from loragw.engine import LLM, SamplingParams
from loragw.engine.snapshot import engine_info
from loragw.gateway.bench.server import serve_subprocess

pytestmark = pytest.mark.slow  # quantized checkpoints made in llm-compressor's venv

SCHEME = "w4a16-asym-g32"


def test_a_quantized_base_serves_an_uploaded_adapter_as_offline(quant_llama, tmp_path):
    model = quant_llama.checkpoints[SCHEME].dir
    adapter = quant_llama.adapters["all-r16"]
    prompt = quant_llama.prompts[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(model, device="cpu", max_model_len=256) as offline:
        offline.add_adapter("tuned", adapter)
        base_out, tuned_out = offline.generate([prompt, prompt], params, adapters=[None, "tuned"])
        info = engine_info(offline.engine)
    assert base_out.token_ids != tuned_out.token_ids

    with serve_subprocess(["--model", model, "--device", "cpu", "--max-model-len", "256",
                           "--quantization", "compressed-tensors",
                           "--adapter-dir", str(tmp_path / "store")]) as url:
        files = {part: (name, (Path(adapter) / name).read_bytes()) for part, name in
                 (("adapter_config", "adapter_config.json"),
                  ("adapter_model", "adapter_model.safetensors"))}
        uploaded = httpx.post(url + "/admin/adapters", data={"adapter_id": "tuned"},
                              files=files, timeout=60)
        assert uploaded.status_code == 201, uploaded.text
        for name, want in ((Path(model).name, base_out), ("tuned", tuned_out)):
            body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True}
            got = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert got.status_code == 200, got.text
            assert got.json()["choices"][0]["text"] == want.text, name
        metrics = httpx.get(url + "/metrics").text
    line = (f'loragw_model_weight_bytes{{quantization="{info.quantization}"}} '
            f"{float(info.weight_bytes)}")
    assert line in metrics, [m for m in metrics.splitlines() if "weight_bytes" in m]
    assert "int4 group 32 asym" in info.quantization


def test_a_quantization_flag_that_contradicts_the_checkpoint_stops_the_server(quant_llama):
    model = quant_llama.checkpoints[SCHEME].dir
    done = subprocess.run([sys.executable, "-P", "-m", "loragw.gateway.cli", "serve", "--model", model,
                           "--device", "cpu", "--quantization", "awq", "--port", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert ("--quantization awq does not match the checkpoint, which is quantized with "
            "compressed-tensors") in done.stderr
