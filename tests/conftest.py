"""Session fixtures shared by every test package: tiny random checkpoints and the demo model.

Heavy imports (torch, transformers, peft) stay inside the fixtures, so collecting tests that do
not use them stays fast. Tests must not write into the directories these fixtures return.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """`tiny_checkpoint(arch="llama", **overrides) -> str`: the directory of a tiny random
    checkpoint from tests/checkpoints.make_tiny_checkpoint, built once per session for each
    distinct (arch, overrides), e.g. tiny_checkpoint("qwen2"), tiny_checkpoint("llama",
    tie_word_embeddings=True), tiny_checkpoint("mistral", sharded=True)."""
    built: dict[str, str] = {}

    def get(arch: str = "llama", **overrides) -> str:
        key = json.dumps([arch, overrides], sort_keys=True)
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[key] = make_tiny_checkpoint(str(out), arch, **overrides)
        return built[key]

    return get


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    """A directory laid out as `loragw demo --out` lays it out, holding only the demo base model
    (demo_dir / "model", from demo/model.py), built once per session. No adapters: use
    `demo_adapters` for those."""
    from demo.model import build_demo_model

    out = tmp_path_factory.mktemp("demo")
    build_demo_model(str(out))
    return out


@pytest.fixture(scope="session")
def demo_model(demo_dir) -> str:
    """The demo base model's directory, as a string."""
    return str(demo_dir / "model")


@pytest.fixture(scope="session")
def demo_adapters(demo_model, tmp_path_factory) -> dict[str, str]:
    """{name: PEFT folder} of the four demo adapters (demo/adapters.py) for `demo_model`, trained
    once per session in a directory of their own (about a minute of CPU, plus `import peft`)."""
    from demo.adapters import build_demo_adapters

    return build_demo_adapters(demo_model, str(tmp_path_factory.mktemp("demo-adapters")))
