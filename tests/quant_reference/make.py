"""Builds a quantized world in OUT_DIR from OUT_DIR/request.json; run by the quant venv:

    .venv-quant/bin/python tests/quant_reference/make.py OUT_DIR

request.json (written by tests/quant_checkpoints.py): {"arch", "vocab", "schemes": [names of
schemes.SCHEMES], "adapters": {name: LoraConfig keyword arguments}, "requests": [[prompt token
ids, adapter name or null], ...], "max_tokens", "sources": a digest of these scripts, the
caller's cache key}.

It writes, under OUT_DIR: base/ (the float base, tiny.py), adapters/<name>/ (PEFT's), and per
scheme <scheme>/ (the quantized checkpoint) and <scheme>.dequantized/ (its float32 twin from
formats.py); then world.json: {"request", "base", "adapters": {name: dir}, "expected_float",
"schemes": {scheme: {"dir", "dequantized", "family", "activations", "expected", "margins",
"expected_weight_only", "max_weight_error", "seconds"}}, "seconds"}, directories relative to
OUT_DIR.

`expected` is the oracle's tokens per request (reference.py: with the activation quantization
the checkpoint declares), `expected_weight_only` the same with it off (equal to `expected` for
weight-only schemes), `margins` per expected token [its log-probability lead over the runner-up,
the runner-up's id], `activations` whether the checkpoint quantizes activations;
`expected_float` is the float base's. Asserted on the way: every adapter
changes its requests' tokens on the float base; each scheme's weights agree with the tools' own
unpacking and dequantization and lie near the float weights (dequantize.py); each scheme
changes at least one request's tokens against the float base, in both of its answers; a scheme
that quantizes activations answers differently with them off (the oracle really quantizes
them); the float base answers the same after all the quantizing; hf-fp8-block answers as
fp8-block (the same weights, the same activation rule), and gptq-g32 as awq-g32 (one AutoRound
rounding, packed two ways).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time

import dequantize
import reference
import tiny
import torch
from schemes import SCHEMES

logger = logging.getLogger("quant_reference")


def build_scheme(out_dir: str, name: str, base: str, adapters: dict[str, str],
                 requests: list, max_tokens: int, expected_float: list) -> dict:
    started = time.perf_counter()
    scheme = SCHEMES[name]
    ckpt, twin = os.path.join(out_dir, name), os.path.join(out_dir, name + ".dequantized")
    for path in (ckpt, twin):
        shutil.rmtree(path, ignore_errors=True)
    scheme.write(base, ckpt)
    weights = dequantize.dequantize(ckpt, scheme.family, twin)
    config, _ = dequantize.read_checkpoint(ckpt)
    error = dequantize.max_error(weights, base, dequantize.weight_bits(config, scheme.family))
    if scheme.family in ("gptq", "awq"):
        check = dequantize.check_gptq_tool if scheme.family == "gptq" else dequantize.check_awq_tool
        check(ckpt, weights)
        model = reference.load(scheme.family, twin)
    else:
        model = reference.load(scheme.family, ckpt)
        dequantize.check_loaded(model, weights)
    oracle = reference.with_adapters(model, adapters)
    expected, margins = reference.greedy_with_margins(oracle, requests, max_tokens)
    expected_weight_only = expected
    activations = quantizes_activations(config)
    if activations:
        reference.weight_only(model)
        expected_weight_only = reference.greedy(oracle, requests, max_tokens)
        assert expected_weight_only != expected, (
            f"{name}: the oracle's activation quantization changed no request's tokens")
    for label, tokens in (("expected", expected), ("expected_weight_only", expected_weight_only)):
        assert tokens != expected_float, (
            f"{name}: quantizing changed no request's tokens ({label}); lengthen the requests")
    seconds = round(time.perf_counter() - started, 2)
    logger.info("%s: %.1f s, max relative weight error %.4f", name, seconds, error)
    return {"dir": name, "dequantized": name + ".dequantized", "family": scheme.family,
            "activations": activations, "expected": expected, "margins": margins,
            "expected_weight_only": expected_weight_only,
            "max_weight_error": round(error, 5), "seconds": seconds}


def quantizes_activations(config: dict) -> bool:
    """Whether the checkpoint's forward quantizes Linear inputs (compressed-tensors
    input_activations, Hugging Face fp8's activation_scheme)."""
    quant = config["quantization_config"]
    if quant["quant_method"] == "fp8":
        return quant.get("activation_scheme", "dynamic") == "dynamic"
    return any(group.get("input_activations") for group in quant.get("config_groups", {}).values())


def main(out_dir: str) -> None:
    started = time.perf_counter()
    torch.set_num_threads(1)  # a tiny model: a second thread only spins, 30x slower when busy
    with open(os.path.join(out_dir, "request.json")) as f:
        request = json.load(f)
    unknown = sorted(set(request["schemes"]) - set(SCHEMES))
    assert not unknown, f"unknown schemes {unknown}; known: {sorted(SCHEMES)}"
    requests = [(prompt, adapter) for prompt, adapter in request["requests"]]
    max_tokens = request["max_tokens"]

    for stale in ("base", "adapters"):
        shutil.rmtree(os.path.join(out_dir, stale), ignore_errors=True)
    base = tiny.build_base(os.path.join(out_dir, "base"), request["arch"], request["vocab"])
    adapters = tiny.save_adapters(base, os.path.join(out_dir, "adapters"), request["adapters"])
    float_oracle = reference.with_adapters(reference.load("float", base), adapters)
    expected_float = reference.greedy(float_oracle, requests, max_tokens)
    plain = reference.greedy(float_oracle, [(prompt, None) for prompt, _ in requests],
                             max_tokens)
    for name in adapters:
        assert any(want != base_tokens for want, base_tokens, (_, adapter)
                   in zip(expected_float, plain, requests) if adapter == name), (
            f"adapter {name} changes no request's tokens")

    schemes = {name: build_scheme(out_dir, name, base, adapters, requests, max_tokens,
                                  expected_float) for name in request["schemes"]}

    assert reference.greedy(float_oracle, requests, max_tokens) == expected_float, (
        "the float base answers differently after quantizing: a tool patched transformers")
    if {"fp8-block", "hf-fp8-block"} <= set(schemes):
        for answer in ("expected", "expected_weight_only"):
            assert schemes["hf-fp8-block"][answer] == schemes["fp8-block"][answer], (
                f"one weight set, two answers ({answer})")
    if {"gptq-g32", "awq-g32"} <= set(schemes):  # AutoRound's one rounding, packed two ways
        assert schemes["gptq-g32"]["expected"] == schemes["awq-g32"]["expected"], (
            "one weight set, two answers")
    world = {"request": request, "base": "base",
             "adapters": {name: os.path.relpath(path, out_dir) for name, path in adapters.items()},
             "expected_float": expected_float, "schemes": schemes,
             "seconds": round(time.perf_counter() - started, 2)}
    with open(os.path.join(out_dir, "world.json"), "w") as f:
        json.dump(world, f, indent=1)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    main(sys.argv[1])
