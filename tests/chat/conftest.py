"""The chat families' tokenizers, built once per session (a small BPE each, in well under a
second together) into a temporary directory of their own, and their tiny models, trained on
first use."""

from __future__ import annotations

import pytest
from chat_families import FAMILIES
from family_servers import FamilyModels


@pytest.fixture(scope="session")
def chat_tokenizers(tmp_path_factory):
    """Family name -> its tokenizer, loaded back from the directory it was saved to."""
    root = tmp_path_factory.mktemp("chat-tokenizers")
    return {name: family.tokenizer(root / name) for name, family in FAMILIES.items()}


@pytest.fixture(scope="session")
def family_models(tmp_path_factory) -> FamilyModels:
    """Family name -> its tiny trained model (family_models.py), trained on first use."""
    return FamilyModels(tmp_path_factory.mktemp("family-models"))
