"""What this replica serves, as the routes need it once the engine is up: the base model's
name and directory, the engine's fixed facts (EngineInfo: vocabulary, context window, request
limits, adapter spec), the tokenizer (None: prompts must be token ids) and each token's text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from litestar.params import Dependency

from loragw.engine.api import EngineInfo, TokenText


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str  # what clients put in `model` for the base
    path: str  # its directory
    info: EngineInfo
    tokenizer: Any  # transformers' tokenizer, or None
    token_text: TokenText
    started_at: int  # unix time the replica started (the base's model card)


# As a route's dependency: built once by Services, never re-validated per request.
ServedModelDep = Annotated[ServedModel, Dependency(skip_validation=True)]
