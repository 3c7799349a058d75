"""The code's layout (tools/layout.py): imports point one way between packages, no module of a
package imports another that imports it back, modules stay under the size a reader takes in at
once, tests import no other test module, the README's map names what is there, config.json is
read by engine/config.py alone, no model part is probed with hasattr / isinstance outside
the model, and no engine module imports from a higher layer of engine/ (ENGINE_LAYERS)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("layout", ROOT / "tools" / "layout.py")
layout = importlib.util.module_from_spec(_spec)
sys.modules["layout"] = layout  # dataclasses look their module up there
_spec.loader.exec_module(layout)


@pytest.mark.parametrize("check", ["import_problems", "size_problems", "test_import_problems",
                                   "readme_problems", "config_json_problems", "probe_problems",
                                   "layer_problems"])
def test_layout(check):
    problems = list(getattr(layout, check)(ROOT))
    assert not problems, "\n".join(problems)


def test_the_checks_can_fail(tmp_path):
    """A cycle, a module past the limit, a test importing a test, a map naming nothing."""
    pkg = tmp_path / "engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from loragw.engine import b\n")
    (pkg / "b.py").write_text("def f():\n    from loragw.engine.a import x\n" + "\n" * layout.MAX_LINES)
    for name in ("kernels", "adapters", "gateway", "demo"):
        (tmp_path / name).mkdir()
    (tmp_path / "gateway" / "c.py").write_text("from loragw.engine.a import x\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("from test_y import helper\n")
    (tmp_path / "README.md").write_text("## Map\n\n| `engine/a.py` | a |\n| `engine/gone.py` | |\n")
    found = "\n".join(layout.problems(tmp_path))
    assert "import cycle: loragw.engine.a <-> loragw.engine.b" in found
    assert "engine/b.py has" in found
    assert "loragw.gateway.c imports loragw.engine.a: gateway/ takes the engine's names" in found
    assert "imports the test module test_y" in found
    assert "names engine/gone.py, which does not exist" in found
    assert "does not name engine/b.py" in found


def test_config_json_and_probe_checks_can_fail(tmp_path):
    """What the code did before: the demo reading config.json back, adapters/ parsing the dict,
    the loader and the expert slots probing the model's parts."""
    for name in layout.PACKAGES:
        (tmp_path / name).mkdir()
    (tmp_path / "engine" / "config.py").write_text(
        'import json, os\npath = os.path.join("m", "config.json")\nwith open(path) as f:\n'
        '    json.load(f)\n')
    (tmp_path / "demo" / "model.py").write_text(
        'import os\nconfig_path = os.path.join("out", "config.json")\nopen(config_path)\n')
    (tmp_path / "gateway" / "a.py").write_text(
        'from pathlib import Path\nPath("m/config.json").read_text()\n'
        'open("adapter_config.json")\n')
    (tmp_path / "adapters" / "types.py").write_text("def spec(hf_config):\n    return 1\n")
    (tmp_path / "engine" / "layers").mkdir()
    (tmp_path / "engine" / "layers" / "rotary.py").write_text("def rope(hf_config):\n    return 1\n")
    (tmp_path / "engine" / "models").mkdir()
    (tmp_path / "engine" / "models" / "args.py").write_text("def read(hf_config):\n    return 1\n")
    (tmp_path / "engine" / "loader.py").write_text(
        "def f(owner, model):\n    isinstance(owner, Linear)\n"
        '    hasattr(owner, "checkpoint_keys")\n    getattr(model, "expert_modules", None)\n'
        '    getattr(model, "expert_modules")\n    isinstance(owner, int)\n')
    (tmp_path / "engine" / "layers" / "moe.py").write_text('hasattr(x, "shared_expert")\n')
    found = [*layout.config_json_problems(tmp_path), *layout.probe_problems(tmp_path)]
    text = "\n".join(found)
    assert "demo/model.py:3 reads config.json" in text
    assert "gateway/a.py:2 reads config.json" in text
    assert "adapters/types.py:1 names hf_config" in text
    assert "engine/layers/rotary.py:1 names hf_config" in text
    assert "engine/loader.py:2 probes the model's Linear with isinstance()" in text
    assert "engine/loader.py:3 probes the model's checkpoint_keys with hasattr()" in text
    assert "engine/loader.py:4 probes the model's expert_modules with getattr()" in text
    assert len(found) == 7, text  # not engine/config.py, engine/models, adapter_config.json, a
    # plain getattr, isinstance(owner, int), nor engine/layers' probe (it declares the interface)


def test_the_layer_check_can_fail(tmp_path):
    """A layer importing the engine above it (as layers/ imported parallel/'s shard), and a
    module no layer names."""
    layers = tmp_path / "engine" / "layers"
    layers.mkdir(parents=True)
    for folder in (tmp_path / "engine", layers):
        (folder / "__init__.py").write_text("")
    (tmp_path / "engine" / "llm_engine.py").write_text("")
    (layers / "linear.py").write_text("from loragw.engine.llm_engine import LLMEngine\n")
    (tmp_path / "engine" / "odd.py").write_text("")
    found = "\n".join(layout.layer_problems(tmp_path))
    assert ("loragw.engine.layers.linear (layers) imports loragw.engine.llm_engine (engine), "
            "a higher layer" in found)
    assert "loragw.engine.odd is in none of tools/layout.py's ENGINE_LAYERS" in found
