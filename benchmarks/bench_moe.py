"""A Mixture-of-Experts base against a dense one of the same active size, on the CPU.

    python benchmarks/bench_moe.py [--repeats 2] [--threads N] [--json out.json]

Models (random, float32, built once under the temp dir):
    dense   the benchmarks' ~34M Llama (hidden 512, 8 layers, MLP 1376, vocab 8192)
    moe     Mixtral-like: the same attention and vocabulary, 8 experts of width 688, top-2:
            one token multiplies by as many MLP weights as the dense one (2 x 688 = 1376),
            the checkpoint holds 4x the MLP weights
Rows: decode tok/s at batch 1 and 32 (32-token prompts, 32 output tokens each, greedy,
ignore_eos, the offline LLM API; the prefill of the prompts is in the time), then batch 32 with
every request on its own rank-16 adapter: attention-only (q, k, v, o), and on the MoE base an
expert LoRA (target_parameters experts.gate_up_proj and experts.down_proj, PEFT's layout) when
the expert LoRA code is present. At batch 32 the fraction of experts a decode step touches is
counted per MoE layer per step (distinct expert ids / E). Best of --repeats rounds; the machine
is shared, so the load average is printed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    Timer,
    build_random_llama,
    machine,
    save_random,
    write_adapters,
    write_json,
)

from loragw.engine import LLM, SamplingParams  # noqa: E402
from loragw.engine.forward.context import get_forward_context  # noqa: E402

logger = logging.getLogger("bench_moe")

PROMPT_LEN, OUTPUT_LEN, RANK = 32, 32, 16
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ROWS = (("batch 1", 1, None), ("batch 32", 32, None),
        ("batch 32, 32 attention LoRAs", 32, "attention LoRA"),
        ("batch 32, 32 expert LoRAs", 32, "expert LoRA"))  # (row, batch, adapters)
MOE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
           intermediate_size=688, num_local_experts=8, num_experts_per_tok=2, vocab_size=8192,
           max_position_embeddings=2048, tie_word_embeddings=False)


def build_random_mixtral(out_dir: str, seed: int = 0) -> str:
    from transformers import MixtralConfig, MixtralForCausalLM

    return save_random(out_dir, seed, lambda: MixtralForCausalLM(MixtralConfig(**MOE)))


def write_expert_adapters(root: str, base: str, count: int) -> list[str]:
    """`count` rank-16 expert LoRAs: PEFT saves one (its config and key layout), the others are
    that one's tensors redrawn."""
    import safetensors.torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    template = os.path.join(root, "expert00")
    if not os.path.isfile(os.path.join(template, "adapter_model.safetensors")):
        config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=[],
                            target_parameters=["experts.gate_up_proj", "experts.down_proj"])
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config)
        peft.save_pretrained(template)
    tensors = safetensors.torch.load_file(os.path.join(template, "adapter_model.safetensors"))
    dirs = [template]
    for k in range(1, count):
        path = os.path.join(root, f"expert{k:02d}")
        dirs.append(path)
        if os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
            continue
        os.makedirs(path, exist_ok=True)
        g = torch.Generator().manual_seed(k)
        redrawn = {n: torch.randn(t.shape, generator=g) * (0.01 if "lora_B" in n else 0.05)
                   for n, t in tensors.items()}
        safetensors.torch.save_file(redrawn, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(template, "adapter_config.json")) as f, \
                open(os.path.join(path, "adapter_config.json"), "w") as out:
            out.write(f.read())
    return dirs


class ExpertCounter:
    """Distinct experts per MoE layer per decode step at a given batch size, via pre-hooks."""

    def __init__(self, llm: LLM, batch: int):
        self.batch, self.fractions = batch, []
        model = llm.engine.runner.model
        self.hooks = [experts.register_forward_pre_hook(self._count)
                      for _, experts in model.expert_modules()]

    def _count(self, experts, args) -> None:
        x, topk_ids, _ = args
        if x.shape[0] == self.batch and get_forward_context().attn.num_decode_tokens == self.batch:
            self.fractions.append(topk_ids.unique().numel() / experts.num_experts)

    def close(self) -> float:
        for h in self.hooks:
            h.remove()
        return sum(self.fractions) / max(len(self.fractions), 1)


def tok_s(llm: LLM, batch: int, adapters: list[str] | None = None,
          max_tokens: int = OUTPUT_LEN) -> float:
    vocab = llm.engine.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(10, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with Timer() as t:
        outs = llm.generate(prompts, params, adapters=adapters)
    return sum(len(o.token_ids) for o in outs) / t.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    root = os.path.join(tempfile.gettempdir(), "loragw-bench-moe")
    bases = {"dense": build_random_llama(os.path.join(root, "dense")),
             "moe": build_random_mixtral(os.path.join(root, "moe"))}
    with open(os.path.join(bases["dense"], "config.json")) as f:
        from transformers import LlamaConfig
        dense_config = LlamaConfig(**json.load(f))
    attn = write_adapters(os.path.join(root, "attn"), dense_config, ATTENTION, 32, seed=1,
                          rank=RANK)  # the same shapes on both bases
    try:
        import loragw.engine.lora.expert_slots  # noqa: F401  the expert-LoRA work, once it has landed
        expert = write_expert_adapters(os.path.join(root, "expert"), bases["moe"], 32)
    except ImportError:
        expert = None
    llms, results = {}, {}
    for name, path in bases.items():
        llm = llms[name] = LLM(path, device="cpu", dtype="float32", max_num_seqs=32,
                               max_loras=32, max_lora_rank=RANK,
                               max_model_len=PROMPT_LEN + OUTPUT_LEN + 8)
        total, active = llm.engine.runner.model.parameter_counts()
        results[name] = {"total_params": total, "active_params": active}
        for label, dirs in (("attention LoRA", attn), ("expert LoRA", expert)):
            if dirs is not None and (label != "expert LoRA" or name == "moe"):
                for i, d in enumerate(dirs):
                    llm.add_adapter(f"{label}-{i}", d)
        tok_s(llm, 32, max_tokens=2)  # warm-up
    # Rounds interleave the two models row by row, so a burst of load elsewhere on the shared
    # machine hits both; the best of each is kept.
    for _ in tqdm(range(args.repeats), desc="rounds"):
        for key, batch, adapters in ROWS:
            for name, llm in llms.items():
                if adapters == "expert LoRA" and (expert is None or name == "dense"):
                    continue
                names = [f"{adapters}-{i}" for i in range(batch)] if adapters else None
                if names:  # the 32 adapters into the 32 slots, untimed
                    tok_s(llm, batch, names, max_tokens=2)
                counter = ExpertCounter(llm, batch) if name == "moe" else None
                row = results[name]
                row[key] = max(row.get(key, 0.0), tok_s(llm, batch, names))
                if counter is not None:
                    row[f"{key}: experts touched"] = counter.close()
    for name, row in results.items():
        print(name, json.dumps(row), flush=True)
    print(f"machine: {machine()}, load average {os.getloadavg()}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
