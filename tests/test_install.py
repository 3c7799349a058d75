"""What a user installs, checked the way they install it.

The wheel is built from the Dockerfile's own build context (the files its COPY lines name, so a
file the image needs and the Dockerfile forgets fails here), installed into a fresh venv beside
today's transformers and the Hub's `kernels` (whose import name the project once shadowed),
and driven through its console script from outside the checkout and from inside it. The image
itself: tests/test_image.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from loragw.gateway.bench.server import free_port, stop_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")  # the Makefile's, a CPU build here
NEWER_TRANSFORMERS = "transformers>=5.25"  # the first that imports the Hub's `kernels`
START_TIMEOUT_S = 300


def dockerfile_sources(dockerfile: Path = ROOT / "Dockerfile") -> list[str]:
    """The checkout paths the Dockerfile copies into its build (COPY lines without --from)."""
    sources = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            sources += [w.rstrip("/") for w in words[1:-1] if not w.startswith("--")]
    return sources


def run(argv: list, cwd: Path, timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True,
                            timeout=timeout, **kwargs)
    assert result.returncode == 0, f"{argv}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def build_context(tmp_path_factory) -> Path:
    """The Dockerfile's build context, as its COPY lines take it from the checkout."""
    context = tmp_path_factory.mktemp("context")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for source in dockerfile_sources():
        path = ROOT / source
        if path.is_dir():
            shutil.copytree(path, context / source, ignore=ignore)
        else:
            shutil.copy2(path, context / source)
    return context


@pytest.fixture(scope="module")
def wheel(build_context, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", out, build_context],
        cwd=out)
    (found,) = out.glob("lora_gateway-*.whl")
    return found


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory, user_pip_cache) -> Path:
    """A fresh venv holding the wheel, torch, the newest transformers pip resolves (>= 5.25)
    and the Hub's `kernels`, as a user installs them: torch first, then the rest."""
    path = tmp_path_factory.mktemp("venv")
    run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", path], cwd=path)
    pip = [path / "bin" / "python", "-m", "pip", "install", "--quiet"]
    env = {**os.environ, "PIP_CACHE_DIR": user_pip_cache}  # what `make install` downloaded
    run([*pip, TORCH_SPEC], cwd=path, env=env)
    run([*pip, wheel, NEWER_TRANSFORMERS, "kernels"], cwd=path, env=env)
    return path


def test_the_wheel_installs_one_import_name_with_its_c_sources(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"loragw"}
    for package in ("engine", "kernels", "adapters", "gateway", "demo"):
        modules = {f"loragw/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / package).rglob("*.py")}
        assert not modules - set(names), f"modules the wheel leaves out: {modules - set(names)}"
    c_sources = {p.name for p in (ROOT / "kernels" / "csrc").iterdir()}
    assert {n.rpartition("/")[2] for n in names if n.startswith("loragw/kernels/csrc/")} == c_sources
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_the_hubs_kernels_and_transformers_import_beside_it(venv, tmp_path):
    script = ("import kernels, transformers, loragw.kernels, loragw.engine\n"
              "from loragw import LLM, SamplingParams\n"
              "print(kernels.__file__, transformers.__version__, loragw.kernels.__file__)")
    kernels_file, version, ours = run([venv / "bin" / "python", "-c", script], cwd=tmp_path).stdout.split()
    site = str(venv / "lib")
    assert kernels_file.startswith(site) and ours.startswith(site)
    assert "loragw" in Path(ours).parts
    assert tuple(int(p) for p in re.findall(r"\d+", version)[:2]) >= (5, 25)


@pytest.fixture(scope="module")
def demo(venv, tmp_path_factory) -> Path:
    """`loragw demo` from a directory outside the checkout: the demo built where `loragw serve
    --demo` looks for it (under HOME, the test session's own)."""
    cwd = tmp_path_factory.mktemp("elsewhere")
    out = run([venv / "bin" / "loragw", "demo"], cwd=cwd).stdout.splitlines()
    model = Path(out[0].removeprefix("model "))
    assert (model / "config.json").is_file() and len(out) > 1, out
    return model


def test_transformers_builds_the_demo_model(venv, demo, tmp_path):
    script = ("import sys; from transformers import AutoModelForCausalLM\n"
              "model = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
              "print(type(model).__name__)")
    name = run([venv / "bin" / "python", "-c", script, demo], cwd=tmp_path).stdout.strip()
    assert name == "LlamaForCausalLM"


@contextmanager
def serving(venv: Path, cwd: Path, *args: str) -> Iterator[str]:
    """`loragw serve --demo` started by its console script in `cwd`; yields its URL once ready."""
    port = free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([venv / "bin" / "loragw", "serve", "--demo", "--port", str(port), *args],
                            cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"loragw serve --demo did not start in {cwd}:\n"
                            f"{log.read().decode(errors='replace')[-4000:]}")
            time.sleep(0.5)
        yield url
    finally:
        stop_server(proc)
        log.close()


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("where", ["outside", "checkout"])
def test_the_installed_demo_answers_a_chat_request(venv, demo, where, tmp_path):
    """From a directory of its own, and from the checkout, where the folders kernels/ and
    adapters/ must not shadow the Hub's `kernels` for the server or its engine process."""
    import openai

    cwd = tmp_path if where == "outside" else ROOT
    with serving(venv, cwd) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        models = [m.id for m in client.models.list().data]
        adapter = next(m for m in models if m != "demo")
        answer = client.chat.completions.create(
            model=adapter, max_tokens=16, temperature=0,
            messages=[{"role": "user", "content": "Say something."}])
    assert answer.choices[0].message.content
    assert answer.usage.completion_tokens > 0
