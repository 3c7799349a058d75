"""Adapter folders as the admin API's upload takes them."""

from __future__ import annotations

import os


def read_files(folder) -> tuple[bytes, bytes]:
    """The bytes of a PEFT folder's adapter_config.json and adapter_model.safetensors."""
    with open(os.path.join(folder, "adapter_config.json"), "rb") as f:
        config = f.read()
    with open(os.path.join(folder, "adapter_model.safetensors"), "rb") as f:
        return config, f.read()
