"""The architectures the engine serves, by the name config.json gives in `architectures`.

Each family module declares the classes it builds; `model_class` is the one place a checkpoint's
architecture is decided, and an architecture nobody declares fails here, named, with the list.
Every model class offers what the loader, the runner and the adapter slots use:
    args                      ModelArgs-like: num_layers, vocab_size, hidden_size, ...
    model.embed_tokens        VocabEmbedding;  lm_head: LMHead
    merged_projections        checkpoint name fragment -> (our module, slice name)
    fused_projections         checkpoint module holding several slices -> ((slice, rows), ...)
    lora_linears()            (layer index, Linear) of every projection an adapter may adapt
    attention_layers()        the PagedAttention of every layer, in order
    forward / compute_logits
    checkpoint_target(name)   a family's own placement of a checkpoint tensor (MoE experts)
MoE bases (engine/models/moe.py) add expert_modules().
"""

from __future__ import annotations

from torch import nn

from engine.models import gemma, llama, moe, phi3

FAMILIES = (llama, phi3, gemma, moe)  # each with ARCHITECTURES: {config.json name: model class}
ARCHITECTURES: dict[str, type[nn.Module]] = {
    name: cls for family in FAMILIES for name, cls in family.ARCHITECTURES.items()}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def architecture(hf_config: dict) -> str:
    archs = hf_config.get("architectures") or []
    return archs[0] if archs else str(hf_config.get("model_type", "?"))


def model_class(hf_config: dict) -> type[nn.Module]:
    """The model class that serves this config.json, or a ValueError naming what is served."""
    arch = architecture(hf_config)
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return ARCHITECTURES[arch]
