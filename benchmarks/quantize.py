"""Quantize a float checkpoint with llm-compressor, as a user would (no calibration data: the
data-free schemes). Runs in the quant venv (`make quant-tools`: llm-compressor pins its own
transformers), not the project's:

    .venv-quant/bin/python benchmarks/quantize.py SRC OUT SCHEME [--group-size N]

SCHEME: an llm-compressor preset (W4A16, W4A16_ASYM, W8A16, W8A8, FP8_DYNAMIC, FP8_BLOCK); with
--group-size N, W4A16 / W4A16_ASYM / W8A16 with groups of N columns instead of the preset's 128
(0: one scale per output channel).
"""

from __future__ import annotations

import argparse
import os

import torch
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM


def recipe(scheme: str, group_size: int | None) -> QuantizationModifier:
    if group_size is None:
        return QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    weights = {"num_bits": 8 if scheme.startswith("W8") else 4, "type": "int",
               "strategy": "group" if group_size else "channel",
               "group_size": group_size or None, "symmetric": not scheme.endswith("_ASYM")}
    return QuantizationModifier(targets="Linear", ignore=["lm_head"], config_groups={
        "group_0": {"targets": ["Linear"], "weights": weights}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("src")
    parser.add_argument("out")
    parser.add_argument("scheme")
    parser.add_argument("--group-size", type=int)
    args = parser.parse_args()
    if os.path.isfile(os.path.join(args.out, "config.json")):
        return
    model = AutoModelForCausalLM.from_pretrained(args.src, dtype=torch.float32)
    oneshot(model=model, recipe=recipe(args.scheme, args.group_size))
    model.save_pretrained(args.out, save_compressed=True)
    for name in os.listdir(args.src):  # the tokenizer, its config and chat template
        if name.startswith(("tokenizer", "special_tokens")) or name.endswith(".jinja"):
            with open(os.path.join(args.src, name), "rb") as f, \
                    open(os.path.join(args.out, name), "wb") as g:
                g.write(f.read())


if __name__ == "__main__":
    main()
