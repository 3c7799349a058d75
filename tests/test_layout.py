"""The code's layout (tools/layout.py): imports point one way between packages, no module of a
package imports another that imports it back, modules stay under the size a reader takes in at
once, tests import no other test module, and the README's map names what is there."""

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
                                   "readme_problems"])
def test_layout(check):
    problems = list(getattr(layout, check)(ROOT))
    assert not problems, "\n".join(problems)


def test_the_checks_can_fail(tmp_path):
    """A cycle, a module past the limit, a test importing a test, a map naming nothing."""
    pkg = tmp_path / "engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from engine import b\n")
    (pkg / "b.py").write_text("def f():\n    from engine.a import x\n" + "\n" * layout.MAX_LINES)
    for name in ("kernels", "adapters", "gateway", "demo"):
        (tmp_path / name).mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("from test_y import helper\n")
    (tmp_path / "README.md").write_text("## Map\n\n| `engine/a.py` | a |\n| `engine/gone.py` | |\n")
    found = "\n".join(layout.problems(tmp_path))
    assert "import cycle in engine: engine.a <-> engine.b" in found
    assert "engine/b.py has" in found
    assert "imports the test module test_y" in found
    assert "names engine/gone.py, which does not exist" in found
    assert "does not name engine/b.py" in found
