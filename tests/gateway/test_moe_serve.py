"""`loragw serve` on a Mixture-of-Experts base: an adapter with expert LoRA (PEFT's
target_parameters on the fused experts, plus q_proj) uploaded through the admin API serves
what the offline engine gives for it, beside the base model, and /metrics reports the base's
total and active parameters."""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from loragw.engine import LLM, SamplingParams
from loragw.engine.snapshot import engine_info
from loragw.gateway.bench.server import serve_subprocess

PROMPT = [5, 17, 42, 99, 7, 300, 12, 64]


def expert_adapter(base: str, out: str) -> str:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj"],
                        target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    get_peft_model(model, config).save_pretrained(out)
    return out


def test_an_uploaded_expert_lora_serves_what_the_engine_gives(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint("mixtral")
    folder = expert_adapter(base, str(tmp_path / "experts"))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    offline = LLM(base, device="cpu", dtype="float32", max_model_len=256)
    offline.add_adapter("experts", folder)
    base_out, expert_out = offline.generate([PROMPT, PROMPT], params, adapters=[None, "experts"])
    assert base_out.token_ids != expert_out.token_ids  # the expert LoRA changes the tokens
    info = engine_info(offline.engine)
    assert 0 < info.active_parameters < info.total_parameters

    with serve_subprocess(["--model", base, "--device", "cpu", "--max-model-len", "256",
                           "--adapter-dir", str(tmp_path / "s")]) as url:
        files = {part: (name, (Path(folder) / name).read_bytes()) for part, name in
                 (("adapter_config", "adapter_config.json"),
                  ("adapter_model", "adapter_model.safetensors"))}
        uploaded = httpx.post(url + "/admin/adapters", data={"adapter_id": "experts"},
                              files=files, timeout=60)
        assert uploaded.status_code == 201, uploaded.text
        assert uploaded.json()["targets"] == ["experts.down_proj", "experts.gate_up_proj",
                                              "q_proj"]
        for model, want in ((os.path.basename(base), base_out), ("experts", expert_out)):
            body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True}
            got = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert got.status_code == 200, got.text
            assert got.json()["choices"][0]["text"] == want.text, model
        metrics = httpx.get(url + "/metrics").text
        assert f'loragw_model_parameters{{kind="total"}} {float(info.total_parameters)}' in metrics
        assert f'loragw_model_parameters{{kind="active"}} {float(info.active_parameters)}' in metrics
