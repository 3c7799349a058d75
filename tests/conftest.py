"""Session fixtures shared by every test package: tiny random checkpoints and the demo model,
and a home of the session's own.

Heavy imports (torch, transformers, peft) stay inside the fixtures, so collecting tests that do
not use them stays fast. Tests must not write into the directories these fixtures return.

The home: before any other conftest or test module is imported, HOME, the XDG directories and
HF_HOME point into a temporary directory (`test_home`), and the variables that would lead past
it (a Hub token, cache paths of its own) are unset, for the whole session and every subprocess
a test starts. So a server started without --adapter-dir, huggingface_hub, datasets, lm-eval,
Helm and Triton all write there, never into the user's ~/.cache, and no stored Hub login is
sent anywhere. It is done on import, not in pytest_configure: pytest imports the conftest of a
test's own directory (tests/gateway/conftest.py imports the engine, and so huggingface_hub,
which fixes its paths at import) before it calls pytest_configure.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from checkpoints import make_tiny_checkpoint

# Where each home variable points, under the temporary home.
HOME_LAYOUT = {"HOME": ".", "XDG_CACHE_HOME": ".cache", "XDG_CONFIG_HOME": ".config",
               "XDG_DATA_HOME": ".local/share", "XDG_STATE_HOME": ".local/state",
               "HF_HOME": ".cache/huggingface"}
# Each would lead a test past the temporary home: a credential, a Hub, or a cache of its own.
UNSET_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_OIDC_RESOURCE",
                   "HF_ENDPOINT", "HF_HUB_CACHE", "HF_ASSETS_CACHE", "HF_XET_CACHE",
                   "HF_DATASETS_CACHE", "HF_MODULES_CACHE", "TRANSFORMERS_CACHE", "TORCH_HOME",
                   "TRITON_CACHE_DIR")
# Read their paths from the environment once, at import: they must not be imported before this.
FIXED_AT_IMPORT = ("huggingface_hub", "datasets", "transformers")


def isolate_home() -> tuple[Path, dict[str, str | None]]:
    """Point HOME_LAYOUT's variables into a new temporary directory and unset UNSET_VARIABLES;
    returns (that directory, every variable changed, as it was)."""
    early = [name for name in FIXED_AT_IMPORT if name in sys.modules]
    assert not early, (f"{early} imported before tests/conftest.py set up the test home: they "
                       "would read and write the user's ~/.cache; import them inside fixtures")
    home = Path(tempfile.mkdtemp(prefix="loragw-test-home-"))
    saved = {name: os.environ.get(name) for name in (*HOME_LAYOUT, *UNSET_VARIABLES)}
    for name in UNSET_VARIABLES:
        os.environ.pop(name, None)
    for name, under in HOME_LAYOUT.items():
        os.environ[name] = str((home / under).resolve())
    return home, saved


TEST_HOME, _USER_ENVIRONMENT = isolate_home()
# The oracle (transformers + PEFT) runs float32: every engine and server of the session, and
# every process a test starts, serves float32 unless a test names a dtype, also on CPUs where
# `--dtype auto` picks bfloat16 (AMX, AVX-512 BF16). Read when loragw.engine.config is imported.
assert "loragw.engine.config" not in sys.modules, "set LORAGW_DTYPE before the engine is imported"
os.environ["LORAGW_DTYPE"] = "float32"


def pytest_unconfigure(config):
    for name, value in _USER_ENVIRONMENT.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    shutil.rmtree(TEST_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def test_home() -> Path:
    """The session's HOME (also the root of XDG_*_HOME and HF_HOME), removed at the end."""
    return TEST_HOME


@pytest.fixture(scope="session")
def user_pip_cache() -> str:
    """The user's pip cache (where `make install` left its downloads), for a test that installs
    the project into a venv of its own: pip reads it, the test home stays clean otherwise."""
    if os.environ.get("PIP_CACHE_DIR"):
        return os.environ["PIP_CACHE_DIR"]
    cache = _USER_ENVIRONMENT["XDG_CACHE_HOME"] or os.path.join(
        _USER_ENVIRONMENT["HOME"] or os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "pip")


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
def quant_llama(tmp_path_factory):
    """tests/quant_checkpoints.py's Llama world (every scheme the tools write, its adapters and
    oracle), built once per session in llm-compressor's venv."""
    from quant_checkpoints import build_world

    return build_world(str(tmp_path_factory.mktemp("quant-llama")), "llama")


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    """A directory laid out as `loragw demo --out` lays it out, holding only the demo base model
    (demo_dir / "model", from demo/model.py), built once per session. No adapters: use
    `demo_adapters` for those."""
    from loragw.demo.model import build_demo_model

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
    from loragw.demo.adapters import build_demo_adapters

    return build_demo_adapters(demo_model, str(tmp_path_factory.mktemp("demo-adapters")))
