"""The architectures the engine serves, by the name config.json gives in `architectures`, and
what each offers adapters.

Each family module declares the classes it builds; `model_class` is the one place a checkpoint's
architecture is decided, and an architecture nobody declares fails here, named, with the list.
`model_args` reads a config.json dict (engine/config.py opens the file, nowhere else does) into
the family's args once: every fact the model, its layers and the engine use is one of their
fields, and the dict goes no further. `adapter_spec` derives what adapters may target from the
same args, so adapters are checked against the shapes the engine builds.

The contract, as code with defaults (engine/models/base.py CausalLM, engine/layers/parts.py):
    make_args(hf_config)      the family's args (engine/models/args.py ModelArgs and subclasses)
    __init__(args, shard)     built from them alone
    adapter_spec(...)         what adapters may target: shapes, fused layout, experts, ties
    model.embed_tokens        VocabEmbedding;  lm_head: LMHead;  model.layers: Layers
    merged_projections        checkpoint name fragment -> (our module, slice name); {} default
    fused_modules             checkpoint module holding several slices -> the slices (Phi-3);
                              fused_projections adds their rows
    lora_linears()            (layer index, Linear) of every projection an adapter may adapt,
                              each layer's Block.lora_linears() (attention's, then the MLP's)
    expert_modules()          (layer index, Experts) of every sparse layer; empty when dense
    attention_layers()        the PagedAttention of every layer, in order
    checkpoint_target(name)   a family's own placement of a checkpoint tensor (None default)
    parameter_counts()        (total, active) parameters
    forward / compute_logits
Every module that owns parameters is a Loadable: the loader asks it checkpoint_keys(name) and
checkpoint_part(slice, tensor). Attention always has q_norm and k_norm (nn.Identity when the
family has none; per head, or over the whole projection as ModelArgs.qk_norm says).
"""

from __future__ import annotations

import os

from loragw.adapters.types import BaseModelSpec
from loragw.engine.models import gemma, llama, moe, phi3
from loragw.engine.models.args import ModelArgs, architecture
from loragw.engine.models.base import CausalLM

__all__ = ["ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "adapter_spec", "architecture",
           "base_spec", "model_args", "model_class"]

FAMILIES = (llama, phi3, gemma, moe)  # each with ARCHITECTURES: {config.json name: model class}
ARCHITECTURES: dict[str, type[CausalLM]] = {
    name: cls for family in FAMILIES for name, cls in family.ARCHITECTURES.items()}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def model_class(config: dict | ModelArgs) -> type[CausalLM]:
    """The model class that serves this config.json (as a dict) or these args, or a ValueError
    naming what is served."""
    arch = config.architecture if isinstance(config, ModelArgs) else architecture(config)
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return ARCHITECTURES[arch]


def model_args(hf_config: dict) -> ModelArgs:
    """The family's args of this config.json (as a dict): read once, the dict goes no further."""
    return model_class(hf_config).make_args(hf_config)


def base_spec(args: ModelArgs, max_lora_rank: int, max_full_module_slots: int = 0,
              model_path: str | os.PathLike | None = None,
              dtype: str = "float32") -> BaseModelSpec:
    """What the base these args describe offers adapters; model_path is the served model's
    directory, for its name; dtype the served dtype's name ("bfloat16")."""
    return model_class(args).adapter_spec(args, max_lora_rank, max_full_module_slots,
                                          model_path, dtype)


def adapter_spec(hf_config: dict, max_lora_rank: int, max_full_module_slots: int = 0,
                 model_path: str | os.PathLike | None = None,
                 dtype: str = "float32") -> BaseModelSpec:
    """base_spec of a config.json dict's args (for tools and tests that hold only the dict)."""
    return base_spec(model_args(hf_config), max_lora_rank, max_full_module_slots, model_path,
                     dtype)
