"""The test session's home (tests/conftest.py): whatever a test runs writes under a temporary
HOME, never into the user's ~/.cache, and finds no stored Hub login to send."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def under(path: str | os.PathLike, root: Path) -> bool:
    return Path(os.path.expanduser(path)).resolve().is_relative_to(root.resolve())


def test_the_gateway_defaults_expand_under_the_test_home(test_home):
    from loragw.demo import DEMO_DIR
    from loragw.gateway.common.config import DEFAULT_ADAPTER_DIR

    # `loragw serve` without --adapter-dir, and with --demo
    assert under(DEFAULT_ADAPTER_DIR, test_home), os.path.expanduser(DEFAULT_ADAPTER_DIR)
    assert under(DEMO_DIR, test_home), os.path.expanduser(DEMO_DIR)


def test_hugging_face_caches_and_login_are_the_test_homes(test_home):
    import datasets.config
    import huggingface_hub
    from huggingface_hub import constants

    for path in (constants.HF_HOME, constants.HF_HUB_CACHE, constants.HF_TOKEN_PATH,
                 datasets.config.HF_DATASETS_CACHE, datasets.config.HF_MODULES_CACHE):
        assert under(path, test_home), path
    assert huggingface_hub.get_token() is None  # nothing a fake Hub could be sent


def test_a_subprocess_inherits_the_test_home(test_home):
    """What tests start (a server process, lm-eval) sees the same home and caches."""
    script = ("import json, os; from huggingface_hub import constants; print(json.dumps("
              "[os.path.expanduser('~/.cache/lora-gateway'), constants.HF_HUB_CACHE, "
              "os.environ.get('HF_TOKEN')]))")
    out = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    store, hub_cache, token = json.loads(out)
    assert under(store, test_home) and under(hub_cache, test_home) and token is None
