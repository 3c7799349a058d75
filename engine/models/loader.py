"""Load a Hugging Face checkpoint directory into our model: safetensors only, never pickle.

The model is built on the meta device, materialised empty on the target device, then every
parameter is filled from the checkpoint (merged projections slice by slice). A parameter the
checkpoint does not fill is an error, not a silently random weight; so is a tensor that is not
finite once cast to the served dtype (NaN / inf in the checkpoint, or values past float16's
range under --dtype float16), named with what to do instead of serving infs.

Each parameter's owner (an engine.layers.parts.Loadable) says which checkpoint keys fill it and
which part of a checkpoint tensor this rank holds; the model (engine/models/base.py) says how
checkpoint names map to its modules (merged, fused, or its own placement).

A quantized checkpoint (engine/quant/): each projection its scheme quantizes is made to hold
its weight quantized before the model is materialised, so no full-precision copy is ever
allocated; that module's tensors (weight_packed, scales, ...) are gathered as they are read,
converted to kernels/quant.py's layout once all are in (engine/quant/formats.py), and placed
slice by slice like a weight.
"""

from __future__ import annotations

import json
import logging
import os

import torch
from safetensors import safe_open
from tqdm import tqdm

from loragw.engine.distributed.shard import ONE, Shard
from loragw.engine.layers.parts import Loadable
from loragw.engine.models import model_class
from loragw.engine.models.args import ModelArgs
from loragw.engine.models.base import CausalLM
from loragw.engine.quant import shard as quant_shard
from loragw.engine.quant.formats import PARTS, convert
from loragw.engine.quant.scheme import QuantConfig, WeightScheme

logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, name) for name in shards]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    pickled = [n for n in os.listdir(model_dir) if n.endswith(PICKLE_SUFFIXES)]
    if pickled:
        raise ValueError(f"{model_dir} holds only pickled weights ({', '.join(sorted(pickled))}); "
                         "pickle files are never loaded: convert the checkpoint to safetensors")
    raise ValueError(f"{model_dir} has no model.safetensors or model.safetensors.index.json")


def load_model(model_dir: str, args: ModelArgs, dtype: torch.dtype, device: torch.device,
               shard: Shard = ONE, quant: QuantConfig | None = None) -> CausalLM:
    """The model, or under tensor parallelism this rank's part of every layer (each tensor
    read whole, cut by the module it fills); `quant`: the checkpoint's quantization."""
    with torch.device("meta"):
        model = model_class(args)(args, shard)
    model.to(dtype)  # on the meta device: no memory yet
    quantized = _quantize(model, quant) if quant is not None else {}
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    required = set(_required_keys(model))
    filled: set[str] = set()
    pending: dict[str, dict[str, torch.Tensor]] = {}  # quantized module -> its tensors so far
    for path in tqdm(checkpoint_files(model_dir), desc="loading weights", unit="file",
                     disable=not logger.isEnabledFor(logging.INFO)):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                module, _, suffix = name.rpartition(".")
                if module in quantized and suffix in PARTS[quant.method]:
                    pending.setdefault(module, {})[suffix] = f.get_tensor(name)
                else:
                    filled.update(_assign(model, params, name, f.get_tensor(name)))
    for module, parts in pending.items():
        linear, slice_name, scheme, keys = quantized[module]
        full = convert(quant, scheme, module, parts)
        for name, part in _quant_slices(model, linear, slice_name, full, module):
            linear.load_quant(name, part, module)
            filled.add(keys[name])
    # a fused tensor (`...experts.gate_up_proj`) fills every per-expert key of its name
    missing = sorted(k for k in required - filled if k.split(":")[0] not in filled)
    if missing:
        raise ValueError(f"checkpoint {model_dir} does not provide {len(missing)} weights, "
                         f"e.g. {', '.join(missing[:5])}")
    return model.eval()


def _quantize(model: CausalLM, quant: QuantConfig) -> dict[str, tuple]:
    """Make every projection the scheme quantizes hold its weight quantized; returns checkpoint
    module -> (our Linear, its slice there or None for all of it, the scheme, slice -> the
    `qweight` key it fills). (Config refused quantized MoE bases: their experts stay as built.)"""
    names = {module: name for name, module in model.named_modules()}
    out: dict[str, tuple] = {}
    for _, linear in model.lora_linears():
        name = names[linear]
        modules = _checkpoint_modules(model, name, linear.slice_names)
        schemes = {quant.scheme(module) for module, _ in modules}
        if len(schemes) > 1:
            raise ValueError(f"{', '.join(m for m, _ in modules)} are quantized differently "
                             f"({quant.method}): the engine serves them as one projection, which "
                             "needs one scheme")
        scheme: WeightScheme | None = schemes.pop()
        if scheme is None:
            continue
        linear.quantize(scheme)
        keys = dict(zip(linear.slice_names, linear.checkpoint_keys(f"{name}.qweight"),
                        strict=True))
        out |= {module: (linear, slice_name, scheme, keys) for module, slice_name in modules}
    return out


def _quant_slices(model: CausalLM, linear, slice_name: str | None, full, module: str):
    """(slice, its QuantWeight) of one checkpoint module: a fused one (Phi-3's qkv_proj) split
    by its slices' rows, else the one slice it fills."""
    if slice_name is not None or len(linear.slice_names) == 1:
        return [(slice_name or linear.slice_names[0], full)]
    widths = model.fused_projections[module.rpartition(".")[2]]
    if full.out_features != sum(rows for _, rows in widths):
        raise ValueError(f"checkpoint module {module!r} has {full.out_features} rows, the model "
                         f"expects {sum(rows for _, rows in widths)}")
    out, start = [], 0
    for name, rows in widths:
        out.append((name, quant_shard.rows(full, start, rows)))
        start += rows
    return out


def _checkpoint_modules(model: CausalLM, name: str,
                        slices: tuple[str, ...]) -> list[tuple[str, str | None]]:
    """Checkpoint modules filling our Linear `name`: (module, our slice; None: every slice)."""
    parent, _, own = name.rpartition(".")
    if own in model.fused_projections or len(slices) == 1:
        return [(name if own in model.fused_projections else f"{parent}.{slices[0]}", None)]
    return [(f"{parent}.{s}", s) for s in slices]


def _required_keys(model: CausalLM):
    """Every key the checkpoint must fill: per parameter, what its owner says (a merged
    projection's slices `...qkv_proj.weight:k_proj`, MoE experts' per expert and half)."""
    for name, _ in model.named_parameters():
        yield from _owner(model, name).checkpoint_keys(name)


def _owner(model: CausalLM, name: str) -> Loadable:
    """The Loadable module holding parameter `name`."""
    return model.get_submodule(name.rpartition(".")[0])


def _assign(model: CausalLM, params: dict, name: str, tensor: torch.Tensor) -> list[str]:
    """Copy one checkpoint tensor into its (possibly merged) parameter; return what it filled."""
    if "rotary_emb.inv_freq" in name:
        return [name]  # derived from config; some old checkpoints store it
    if name == "lm_head.weight" and model.args.tie_word_embeddings:
        return [name]
    if found := model.checkpoint_target(name):
        _copy(found[0], tensor, name)  # MoE: a per-expert tensor into the fused experts
        return [found[1]]
    for fragment, slices in model.fused_projections.items():
        if f".{fragment}." in name:
            return _assign_fused(model, params, name, tensor, slices)
    for fragment, (merged, slice_name) in model.merged_projections.items():
        if f".{fragment}." in name:
            merged_name = name.replace(f".{fragment}.", f".{merged}.")
            if merged_name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            owner = _owner(model, merged_name)
            _copy(params[merged_name][owner.slice_rows(slice_name)],
                  owner.checkpoint_part(slice_name, tensor), name)
            return [f"{merged_name}:{slice_name}"]
    if name not in params:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    _copy(params[name], _owner(model, name).checkpoint_part(None, tensor), name)
    return [name]


def _assign_fused(model: CausalLM, params: dict, name: str, tensor: torch.Tensor,
                  slices: tuple[tuple[str, int], ...]) -> list[str]:
    """A checkpoint tensor holding several slices along its rows (Phi-3's qkv_proj [q+2kv, H]):
    each slice's rows go to that slice of our Linear (this rank's part of them)."""
    if name not in params:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    widths = [rows for _, rows in slices]
    if tensor.shape[0] != sum(widths):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model "
                         f"expects {sum(widths)} rows ({', '.join(s for s, _ in slices)})")
    owner = _owner(model, name)
    for (slice_name, _), part in zip(slices, tensor.split(widths), strict=True):
        _copy(params[name][owner.slice_rows(slice_name)], owner.checkpoint_part(slice_name, part),
              f"{name} ({slice_name} rows)")
    return [f"{name}:{slice_name}" for slice_name, _ in slices]


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, "
                         f"the model expects {tuple(dst.shape)}")
    dst.copy_(src)
    if not bool(torch.isfinite(dst).all()):
        raise _not_finite(name, src, dst.dtype)


def _not_finite(name: str, src: torch.Tensor, dtype: torch.dtype) -> ValueError:
    """Why checkpoint tensor `name` (`src`, as stored) is not finite once cast to `dtype`."""
    finite = torch.isfinite(src)
    if not bool(finite.all()):
        return ValueError(f"checkpoint tensor {name!r} holds {int((~finite).sum())} NaN or "
                          "infinite values: the checkpoint is corrupt; download or export it again")
    peak = src.abs().max().item()
    served = str(dtype).removeprefix("torch.")
    fits = [f"--dtype {n}" for n, d in (("bfloat16", torch.bfloat16), ("float32", torch.float32))
            if d != dtype and peak <= torch.finfo(d).max]
    instead = (f"serve this checkpoint with {' or '.join(fits)}" if fits
               else "no served dtype holds it")
    return ValueError(f"checkpoint tensor {name!r} holds values up to {peak:.4g} in magnitude, "
                      f"past {served}'s largest ({torch.finfo(dtype).max:.6g}), so it would load "
                      f"as inf; {instead}")
