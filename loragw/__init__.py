"""lora-gateway: one resident base model serving many LoRA fine-tunes, batched together.

    from loragw import LLM, SamplingParams     # the offline API (loragw.engine)

The distribution's one import name. Its packages are the checkout's folders, installed under it
(pyproject.toml's package-dir): loragw.engine, loragw.kernels, loragw.adapters, loragw.gateway
and loragw.demo. `loragw` on the command line is loragw.gateway.cli.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loragw.engine import LLM, Config, GenerationOutput, SamplingParams

__all__ = ["LLM", "Config", "GenerationOutput", "SamplingParams"]


def __getattr__(name: str):
    # The offline API imports torch: only when it is asked for, so `import loragw.kernels.x`
    # or the CLI's --help does not pay for the engine.
    if name in __all__:
        from loragw import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'loragw' has no attribute {name!r}")
