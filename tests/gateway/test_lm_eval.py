"""EleutherAI's lm-evaluation-harness against the gateway, as people evaluate a fine-tune: the
same tiny local tasks (a multiple-choice one: loglikelihoods through `echo` + `logprobs`; a
generate_until one) run by lm-eval's `local-completions` backend against a live server with an
adapter as `model`, and by lm-eval's own `hf` backend with `peft=` that adapter. Per-sample
loglikelihoods agree within 1e-4 and generations are identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

LM_EVAL = [sys.executable, "-P", "-m", "lm_eval", "run"]
ADAPTER = "lora-0"
MC_DOCS = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Fish live in", "choices": [" water", " trees", " songs"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " seven", " purple"], "answer": 0},
    {"question": "A robot is made of", "choices": [" metal", " soup", " dreams"], "answer": 0},
]
GEN_DOCS = [{"prompt": "Once upon a time"}, {"prompt": "The pirate said"},
            {"prompt": "Tell me about the sea"}]


def write_tasks(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    (root / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    (root / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
""")
    return root


def samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(rows, key=lambda r: r["doc_id"])


def run(args: list[str], out: Path, tasks: Path) -> None:
    # datasets caches the task files it reads (and huggingface_hub would cache downloads) under
    # HF_HOME: this run's own, beside its output, not the user's ~/.cache/huggingface
    hf_home = out.with_name(f"{out.name}-hf-home")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(hf_home), "HF_DATASETS_CACHE": str(hf_home / "datasets"),
           "HF_HUB_CACHE": str(hf_home / "hub"),
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([*LM_EVAL, *args, "--tasks", "tiny_mc,tiny_gen", "--include_path",
                             str(tasks), "--output_path", str(out), "--log_samples"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.slow
def test_lm_eval_through_the_gateway_equals_lm_eval_on_peft(server, model_dir, adapter_dirs,
                                                             tmp_path):
    tasks = write_tasks(tmp_path / "tasks")
    gateway, local = tmp_path / "gateway", tmp_path / "hf"
    run(["--model", "local-completions", "--model_args",
         f"model={ADAPTER},base_url={server.url}/v1/completions,tokenizer={model_dir},"
         # the hf backend's tokenizer adds BOS (the demo tokenizer's default): the same here
         "tokenized_requests=True,add_bos_token=True,num_concurrent=1,max_retries=1"],
        gateway, tasks)
    run(["--model", "hf", "--model_args",
         f"pretrained={model_dir},peft={adapter_dirs[ADAPTER]},dtype=float32", "--device",
         "cpu", "--batch_size", "1"], local, tasks)
    ours, theirs = samples(gateway, "tiny_mc"), samples(local, "tiny_mc")
    assert len(ours) == len(theirs) == len(MC_DOCS)
    for a, b in zip(ours, theirs, strict=True):
        got = [float(r[0][0]) for r in a["resps"]]  # lm-eval logs them as strings
        want = [float(r[0][0]) for r in b["resps"]]
        assert all(abs(x - y) < 1e-4 for x, y in zip(got, want, strict=True)), (got, want)
    ours, theirs = samples(gateway, "tiny_gen"), samples(local, "tiny_gen")
    assert [r["resps"] for r in ours] == [r["resps"] for r in theirs]
    assert any(r["resps"][0][0] for r in ours), "the generations are all empty"
