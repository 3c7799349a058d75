"""Render and lint a Helm chart with Helm's own engine, with or without the `helm` binary.

Two backends, the same results:

- ``cli``: the real ``helm`` on PATH (``helm template`` and ``helm lint --strict``). Chosen
  whenever it is there, so a developer with Helm installed tests exactly what they deploy.
- ``sdk``: ``helm-python-sdk`` from PyPI, which binds Helm's official Go SDK (``pkg/engine``,
  ``pkg/chart/v2/util``, ``pkg/lint``, compiled into ``libhelm_c.so`` inside the wheel)
  through ctypes. Same template engine, same sprig and Helm functions (include, tpl, required,
  lookup, toYaml...), same values coalescing and values.schema.json check as ``helm template``:
  no re-implementation of Helm to drift from it. Used where ``helm`` is not installed (these
  machines, CI).

``LORAGW_HELM_BACKEND=cli|sdk`` forces one. What is left to this module is what the ``helm``
command does after the engine: split each rendered file on ``---``, drop empty documents,
parse the YAML, and order the objects by Helm's install order.

    >>> rendered = render("helm", {"gpu": {"count": 2}}, release="demo", namespace="llm")
    >>> rendered.one("Deployment")["spec"]["replicas"]
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "INSTALL_HINT",
    "HelmUnavailable",
    "LintReport",
    "Manifest",
    "RenderError",
    "Rendered",
    "backend",
    "lint",
    "merge_values",
    "render",
    "split_manifests",
    "to_yaml",
]

INSTALL_HINT = (
    "Helm's engine is not available to render the chart. Install one of:\n"
    "  - the Python binding of Helm's Go SDK (what `make install` and CI use):\n"
    "      .venv/bin/pip install 'helm-python-sdk>=0.2.2'   (or: make install, it is in the dev extra)\n"
    "  - the real helm binary on PATH (https://helm.sh/docs/intro/install/), which is preferred\n"
    "    when present."
)

# Helm's releaseutil.InstallOrder: the order `helm template` prints and `helm install` applies.
INSTALL_ORDER = [
    "PriorityClass", "Namespace", "NetworkPolicy", "ResourceQuota", "LimitRange",
    "PodSecurityPolicy", "PodDisruptionBudget", "ServiceAccount", "Secret", "SecretList",
    "ConfigMap", "StorageClass", "PersistentVolume", "PersistentVolumeClaim",
    "CustomResourceDefinition", "ClusterRole", "ClusterRoleList", "ClusterRoleBinding",
    "ClusterRoleBindingList", "Role", "RoleList", "RoleBinding", "RoleBindingList", "Service",
    "DaemonSet", "Pod", "ReplicationController", "ReplicaSet", "Deployment",
    "HorizontalPodAutoscaler", "StatefulSet", "Job", "CronJob", "IngressClass", "Ingress",
    "APIService", "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
]

# releaseutil.SplitManifests' separator, verbatim.
_SEPARATOR = re.compile(r"(?:^|\s*\n)---\s*")
_SOURCE = re.compile(r"^# Source: (.+)$", re.MULTILINE)


class HelmUnavailable(RuntimeError):
    """Neither the helm binary nor helm-python-sdk is installed."""

    def __init__(self) -> None:
        super().__init__(INSTALL_HINT)


class RenderError(RuntimeError):
    """The chart failed to render: a template error, `required`, or values.schema.json."""


@dataclass(frozen=True)
class Manifest:
    source: str  # template path, e.g. "lora-gateway/templates/deployment.yaml"
    obj: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.obj.get("kind", ""))

    @property
    def name(self) -> str:
        return str(self.obj.get("metadata", {}).get("name", ""))


@dataclass
class Rendered:
    manifests: list[Manifest]
    notes: str | None = None  # NOTES.txt; None where the backend does not produce it (cli)
    backend: str = ""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (m.obj for m in self.manifests)

    def __len__(self) -> int:
        return len(self.manifests)

    def kinds(self) -> list[str]:
        return [m.kind for m in self.manifests]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [m.obj for m in self.manifests if m.kind == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        """The single object of `kind` (and `name`, if given); AssertionError otherwise."""
        found = [o for o in self.of_kind(kind)
                 if name is None or o.get("metadata", {}).get("name") == name]
        if len(found) != 1:
            have = ", ".join(f"{m.kind}/{m.name}" for m in self.manifests)
            raise AssertionError(f"expected one {kind}{' ' + name if name else ''}, "
                                 f"found {len(found)} among: {have}")
        return found[0]


@dataclass
class LintReport:
    backend: str
    ok: bool
    messages: list[str] = field(default_factory=list)  # "[SEVERITY] path: message"


def backend() -> str:
    """'cli' when helm is on PATH, else 'sdk' when helm-python-sdk imports; else raise."""
    forced = os.environ.get("LORAGW_HELM_BACKEND", "").strip().lower()
    if forced not in ("", "cli", "sdk"):
        raise ValueError(f"LORAGW_HELM_BACKEND must be cli or sdk, got {forced!r}")
    if forced in ("", "cli") and shutil.which("helm"):
        return "cli"
    if forced == "cli":
        raise HelmUnavailable()
    try:
        import helm_python  # noqa: F401
    except (ImportError, OSError) as exc:  # OSError: the wheel's native library failed to load
        raise HelmUnavailable() from exc
    return "sdk"


def merge_values(defaults: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """Helm's coalescing of user values over the chart's: maps merge key by key, anything
    else replaces, and null deletes the key."""
    merged = dict(defaults)
    for key, value in (overrides or {}).items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_values(merged[key], value)
        else:
            merged[key] = value
    return merged


def split_manifests(text: str, source: str = "") -> list[Manifest]:
    """One template's output as objects: split like Helm, drop empty and comment-only documents."""
    out = []
    for doc in _SEPARATOR.split(text):
        if not doc.strip():
            continue
        try:
            obj = yaml.safe_load(doc)
        except yaml.YAMLError as exc:
            raise RenderError(f"{source}: rendered YAML does not parse: {exc}\n---\n{doc}") from exc
        if obj is None:
            continue
        if not isinstance(obj, dict):
            raise RenderError(f"{source}: a rendered document is not a mapping:\n{doc}")
        out.append(Manifest(source, obj))
    return out


def _sorted(manifests: list[Manifest]) -> list[Manifest]:
    rank = {kind: i for i, kind in enumerate(INSTALL_ORDER)}
    indexed = list(enumerate(manifests))
    indexed.sort(key=lambda im: (rank.get(im[1].kind, len(INSTALL_ORDER)), im[1].kind, im[0]))
    return [m for _, m in indexed]


def render(chart: str | os.PathLike[str], values: dict[str, Any] | None = None, *,
           release: str = "release", namespace: str = "default") -> Rendered:
    """`helm template RELEASE CHART -n NAMESPACE -f VALUES`, parsed into objects."""
    which = backend()
    chart = os.fspath(chart)
    if which == "cli":
        with tempfile.TemporaryDirectory() as tmp:
            values_file = Path(tmp, "values.yaml")
            values_file.write_text(yaml.safe_dump(values or {}))
            proc = subprocess.run(
                ["helm", "template", release, chart, "--namespace", namespace,
                 "--values", str(values_file)],
                capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RenderError(proc.stderr.strip() or proc.stdout.strip())
        manifests: list[Manifest] = []
        # helm prints "---\n# Source: PATH\n<doc>" per document.
        for doc in _SEPARATOR.split(proc.stdout):
            match = _SOURCE.search(doc)
            manifests.extend(split_manifests(doc, match.group(1) if match else ""))
        return Rendered(manifests, None, "cli")

    import helm_python

    try:
        with helm_python.Chart.load(chart) as loaded:
            files = loaded.render(values or {}, name=release, namespace=namespace,
                                  is_install=True)
    except helm_python.HelmError as exc:
        raise RenderError(str(exc)) from exc
    notes = None
    manifests = []
    for path in sorted(files):
        if path.endswith("NOTES.txt"):
            notes = files[path]
            continue
        if Path(path).name.startswith("_"):  # partials, as in Helm's releaseutil.SortManifests
            continue
        manifests.extend(split_manifests(files[path], path))
    return Rendered(_sorted(manifests), notes, "sdk")


def lint(chart: str | os.PathLike[str], values: dict[str, Any] | None = None, *,
         strict: bool = True) -> LintReport:
    """`helm lint [--strict] CHART -f VALUES`: ok is False on any error (or warning if strict)."""
    which = backend()
    chart = os.fspath(chart)
    if which == "cli":
        with tempfile.TemporaryDirectory() as tmp:
            values_file = Path(tmp, "values.yaml")
            values_file.write_text(yaml.safe_dump(values or {}))
            cmd = ["helm", "lint", chart, "--values", str(values_file)]
            if strict:
                cmd.append("--strict")
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines()
                 if ln.startswith("[") or "Error" in ln]
        return LintReport("cli", proc.returncode == 0, lines)

    import helm_python

    report = helm_python.lint(chart, values or {}, strict=strict)
    names = {0: "UNKNOWN", 1: "INFO", 2: "WARNING", 3: "ERROR"}
    messages = [f"[{names.get(m['severity'], m['severity'])}] {m['path']}: {m['error'].strip()}"
                for m in report.get("messages", [])]
    worst = max((m["severity"] for m in report.get("messages", [])), default=0)
    ok = not report.get("errors") and worst < (2 if strict else 3)
    return LintReport("sdk", ok, messages)


def to_yaml(rendered: Rendered) -> str:
    """The objects as one multi-document YAML stream, like `helm template` prints them."""
    parts = []
    for m in rendered.manifests:
        parts.append(f"---\n# Source: {m.source}\n"
                     + yaml.safe_dump(m.obj, sort_keys=False, default_flow_style=False))
    return "".join(parts)
