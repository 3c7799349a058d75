"""The architectures the engine serves, by the name config.json gives in `architectures`, and
what each offers adapters.

Each family module declares the classes it builds; `model_class` is the one place a checkpoint's
architecture is decided, and an architecture nobody declares fails here, named, with the list.
`adapter_spec` is the one way to a BaseModelSpec: the model class reads its args from the
config.json dict (engine/config.py opens the file, nowhere else does) and derives the spec from
them, so adapters are checked against the shapes the engine builds.

The contract, as code with defaults (engine/models/base.py CausalLM, engine/layers/parts.py):
    make_args(hf_config)      the family's args (engine/models/args.py ModelArgs and subclasses)
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
from loragw.engine.models.args import architecture
from loragw.engine.models.base import CausalLM

__all__ = ["ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "adapter_spec", "architecture",
           "model_class"]

FAMILIES = (llama, phi3, gemma, moe)  # each with ARCHITECTURES: {config.json name: model class}
ARCHITECTURES: dict[str, type[CausalLM]] = {
    name: cls for family in FAMILIES for name, cls in family.ARCHITECTURES.items()}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def model_class(hf_config: dict) -> type[CausalLM]:
    """The model class that serves this config.json, or a ValueError naming what is served."""
    arch = architecture(hf_config)
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return ARCHITECTURES[arch]


def adapter_spec(hf_config: dict, max_lora_rank: int, max_full_module_slots: int = 0,
                 model_path: str | os.PathLike | None = None,
                 dtype: str = "float32") -> BaseModelSpec:
    """What the base of this config.json (as a dict) offers adapters; model_path is the served
    model's directory, for its name; dtype the served dtype's name ("bfloat16")."""
    return model_class(hf_config).adapter_spec(hf_config, max_lora_rank, max_full_module_slots,
                                               model_path, dtype)
