"""The code's layout, checked: import direction between packages, no import cycle inside a
package, modules of at most MAX_LINES lines, tests that import no other test module, a README
map that names every module that exists (and none that does not), config.json read by one
module only, and no probing of the model's parts outside the model (hasattr / isinstance on
them, instead of their declared interface).

    python tools/layout.py          # prints every problem; exit status 1 if there is one

tests/test_layout.py runs the same checks. Imports are read with `ast`, all of them: at module
level, inside functions and under `if TYPE_CHECKING:` (a cycle hidden in a function is still
a cycle a reader has to follow).
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMPORT_ROOT = "loragw"  # the one import name: its folder holds the offline API, nothing else
PACKAGES = ("engine", "kernels", "adapters", "gateway", "demo")  # folders, as loragw.<folder>
MAX_LINES = 300
# Which packages each package may import: imports point one way ("" is loragw itself).
ALLOWED = {"": {"engine"}, "kernels": set(), "adapters": set(),
           "engine": {"kernels", "adapters"}, "demo": {"engine", "adapters"},
           "gateway": {"engine", "adapters", "kernels", "demo"}}
# The one engine module gateway/ may import: it names all the gateway uses of the engine.
ENGINE_API = f"{IMPORT_ROOT}.engine.api"
# Cycles a package keeps on purpose, each with its reason: (module, module) pairs.
ALLOWED_CYCLES: dict[frozenset[str], str] = {}


@dataclass(frozen=True)
class Module:
    name: str  # dotted: loragw.gateway.app (the folder gateway/ installs as loragw.gateway)
    path: Path

    @property
    def package(self) -> str:
        """The package it belongs to: loragw.gateway.http for loragw.gateway.app."""
        parts = self.name.split(".")
        return ".".join(parts[:-1]) if self.path.name != "__init__.py" else self.name


def modules(root: Path = ROOT, packages: tuple[str, ...] = (IMPORT_ROOT, *PACKAGES)
            ) -> dict[str, Module]:
    """Every module of `packages` (folders under root), by its installed dotted name."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if parts[:1] != [IMPORT_ROOT]:
                parts.insert(0, IMPORT_ROOT)
            found[".".join(parts)] = Module(".".join(parts), path)
    return found


def package_of(name: str) -> str:
    """The folder a module's dotted name lives in: engine for loragw.engine.x, "" for loragw."""
    return name.removeprefix(IMPORT_ROOT).removeprefix(".").split(".")[0]


def imports(module: Module, known: dict[str, Module]) -> set[str]:
    """Project modules `module` imports, anywhere in its body."""
    tree = ast.parse(module.path.read_text(), str(module.path))
    out: set[str] = set()
    base = module.name if module.path.name == "__init__.py" else module.package
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            prefix = node.module or ""
            if node.level:
                anchor = base.split(".")[: len(base.split(".")) - node.level + 1]
                prefix = ".".join(anchor + ([node.module] if node.module else []))
            names = [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module.name:
                out.add(name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_problems(root: Path = ROOT) -> Iterator[str]:
    known = modules(root)
    graph = {name: imports(m, known) for name, m in known.items()}
    for name, targets in sorted(graph.items()):
        top = package_of(name)
        for target in sorted(targets):
            other = package_of(target)
            if other != top and other not in ALLOWED[top]:
                yield f"{name} imports {target}: {top} may import only {sorted(ALLOWED[top])}"
            elif top == "gateway" and other == "engine" and target != ENGINE_API:
                yield (f"{name} imports {target}: gateway/ takes the engine's names from "
                       f"{ENGINE_API} only (add it there)")
    # A cycle anywhere in the tree, across folders and packages too: modules that import each
    # other, however far apart (a package's __init__ re-exporting its modules is not one).
    whole = {name: {t for t in targets if known[t].path.name != "__init__.py"}
             for name, targets in graph.items() if known[name].path.name != "__init__.py"}
    for component in cycles(whole):
        if not any(pair <= set(component) for pair in ALLOWED_CYCLES):
            yield f"import cycle: {' <-> '.join(component)}"


def size_problems(root: Path = ROOT) -> Iterator[str]:
    for m in modules(root).values():
        lines = len(m.path.read_text().splitlines())
        if lines > MAX_LINES:
            yield f"{m.path.relative_to(root)} has {lines} lines (> {MAX_LINES}): split it by noun"


def test_import_problems(root: Path = ROOT) -> Iterator[str]:
    """A test module imports helpers (tests/**/non-test_*.py), never another test module."""
    for path in sorted((root / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                targets = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                if target.rpartition(".")[2].startswith("test_"):
                    yield f"{path.relative_to(root)} imports the test module {target}"


_MAP_ENTRY = re.compile(r"`((?:loragw|engine|kernels|adapters|gateway|demo)/[\w/.]*)`")


def readme_problems(root: Path = ROOT) -> Iterator[str]:
    """Every path the README's map names exists, and every module is named (itself, or a
    folder that holds it)."""
    text = (root / "README.md").read_text()
    _, _, mapped = text.partition("## Map")
    named = set(_MAP_ENTRY.findall(mapped))
    for entry in sorted(named):
        if not (root / entry).exists():
            yield f"README's map names {entry}, which does not exist"
    for m in modules(root).values():
        rel = m.path.relative_to(root).as_posix()
        if m.path.name == "__init__.py" and m.path.stat().st_size < 2000:
            continue  # a package's re-exports; its modules are named one by one
        folders = {"/".join(rel.split("/")[:i]) + "/" for i in range(1, rel.count("/") + 1)}
        if rel not in named and not (folders & named):
            yield f"README's map does not name {rel}"


# The one module that opens config.json; the model's args are read from the dict it returns.
CONFIG_READER = "engine/config.py"
CONFIG_DICT = "hf_config"  # that dict's name: read into ModelArgs, it goes no further
CONFIG_DICT_OWNERS = ("engine/models/", CONFIG_READER)  # the only modules that may name it
# A model part's class or attribute: what hasattr / isinstance / getattr(.., default) must not
# probe outside engine/models and engine/layers, which declare the interface that answers it.
MODEL_PARTS = frozenset({
    "Linear", "VocabShard", "VocabEmbedding", "LMHead", "SparseMoeBlock", "Experts", "RMSNorm",
    "q_norm", "k_norm", "shared_expert", "shared_expert_gate", "expert_modules", "lora_linears",
    "checkpoint_keys", "checkpoint_part", "checkpoint_target"})
PART_OWNERS = ("engine/models/", "engine/layers/")
PROBES = {"hasattr": 2, "isinstance": 2, "issubclass": 2, "getattr": 3}  # name -> args it takes
READS = ("open", "read_text", "read_bytes")  # open(path), Path(path).read_text()


def _names_config_json(node: ast.AST, bound: set[str]) -> bool:
    """Whether an expression mentions config.json: the string itself ("config.json", ".../
    config.json", not adapter_config.json) or a name bound to an expression that does."""
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and (
                n.value == "config.json" or n.value.endswith("/config.json")):
            return True
        if isinstance(n, ast.Name) and n.id in bound:
            return True
    return False


def config_json_problems(root: Path = ROOT) -> Iterator[str]:
    """Only CONFIG_READER opens config.json (an open() / read_text() whose path mentions it,
    directly or through a name assigned from it); and outside CONFIG_DICT_OWNERS nothing names
    the dict read from it: the layers take ModelArgs, adapters/ and gateway/ the engine's
    nouns."""
    for m in modules(root).values():
        rel = m.path.relative_to(root).as_posix()
        tree = ast.parse(m.path.read_text(), str(m.path))
        bound = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign)
                 and _names_config_json(n.value, set())
                 for t in n.targets if isinstance(t, ast.Name)}
        for n in ast.walk(tree):
            if not isinstance(n, ast.Call) or rel == CONFIG_READER:
                continue
            func = n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
            receiver = [n.func.value] if isinstance(n.func, ast.Attribute) else []
            if func in READS and any(_names_config_json(a, bound)
                                     for a in [*n.args, *receiver]):
                yield (f"{rel}:{n.lineno} reads config.json: only {CONFIG_READER} does "
                       "(read_hf_config); take the model's facts from the engine")
        if not rel.startswith(CONFIG_DICT_OWNERS):
            for n in ast.walk(tree):
                name = getattr(n, "id", None) or getattr(n, "arg", None) or getattr(n, "attr", None)
                if name == CONFIG_DICT:
                    yield (f"{rel}:{n.lineno} names {CONFIG_DICT}, the config.json dict: only "
                           f"{' and '.join(CONFIG_DICT_OWNERS)} read it; take the fact from "
                           "ModelArgs (engine), the BaseModelSpec or EngineInfo")
                    break


def probe_problems(root: Path = ROOT) -> Iterator[str]:
    """No hasattr / isinstance / issubclass / getattr-with-a-default on a model part (MODEL_PARTS
    named in its arguments) outside PART_OWNERS: a part is asked through its interface."""
    for m in modules(root).values():
        rel = m.path.relative_to(root).as_posix()
        if rel.startswith(PART_OWNERS):
            continue
        for n in ast.walk(ast.parse(m.path.read_text(), str(m.path))):
            if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                    and len(n.args) >= PROBES.get(n.func.id, 99)):
                continue
            named = {getattr(a, "id", None) or getattr(a, "attr", None) or getattr(a, "value", None)
                     for arg in n.args for a in ast.walk(arg)}
            if parts := sorted(p for p in named & MODEL_PARTS):
                yield (f"{rel}:{n.lineno} probes the model's {', '.join(parts)} with "
                       f"{n.func.id}(): ask it through the interface engine/layers/parts.py and "
                       "engine/models/base.py declare")


# engine/'s layers, lowest first, each the folders (or the few modules at engine/'s root, by
# name; "" is engine/__init__) that make it: a module imports its own layer or lower ones only.
ENGINE_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("request", ("request",)),  # a request's nouns: params, sequence, stops, checks, text
    ("chat", ("chat",)),  # a family's reasoning and tool-call syntax, parsed out of its text
    ("forward", ("forward",)),  # what a forward pass reads: context, backends, LoRA metas
    ("distributed", ("distributed",)),  # shard and group primitives, below the layers
    ("quant", ("quant",)),  # the quantized layout the layers hold
    ("layers", ("layers",)),
    ("models", ("models",)),  # the architectures, their args and their loader
    ("config", ("config", "speculative_config")),  # reads config.json into ModelArgs
    ("kv", ("kv",)),
    ("sched", ("sched",)),
    ("lora", ("lora",)),
    ("runner", ("runner",)),
    ("parallel", ("parallel",)),  # the tensor-parallel runner, above the model runner
    ("spec", ("spec",)),  # speculative decoding: proposals and verification around the step
    ("engine", ("llm_engine", "adapter_calls", "snapshot")),
    ("core", ("core",)),  # the engine loop and its two transports
    ("fronts", ("llm", "api", "")),  # the offline API and what the gateway may import
)


# gateway/'s layers, lowest first, the same way.
GATEWAY_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("common", ("common",)),  # config, flags, errors, the shared residency records, tasks
    ("observe", ("observe",)),  # metrics, tracing, the engine watchdog
    ("tenants", ("tenants",)),  # keys, limits, audit, the tenant rules
    ("residency", ("residency",)),  # this replica's adapters and the fleet's catalog
    ("fleet", ("fleet",)),  # routing across replicas
    ("http", ("http",)),  # what the routes share: auth, errors, bodies, jobs, ops
    ("admin", ("admin",)),  # the admin API
    ("openai", ("openai",)),  # the OpenAI API (its adapter routes reuse admin's verbs)
    ("responses", ("responses",)),  # the Responses API, on the OpenAI API's admission
    ("services", ("services",)),  # what the app serves with, built at start
    ("app", ("app",)),  # the Litestar app: routes, dependencies, middleware
    ("bench", ("bench",)),  # `loragw bench`, a client
    ("entry", ("server", "cli", "")),  # `loragw serve`, the command line
)
LAYERS = {"engine": ENGINE_LAYERS, "gateway": GATEWAY_LAYERS}


def layer_of(name: str, layers: tuple[tuple[str, tuple[str, ...]], ...] = ENGINE_LAYERS,
             package: str = "engine") -> int | None:
    """The index in `layers` of module `name` (dotted) of `package`, None if it has none."""
    first = name.removeprefix(f"{IMPORT_ROOT}.{package}").removeprefix(".").split(".")[0]
    return next((i for i, (_, parts) in enumerate(layers) if first in parts), None)


def engine_layer(name: str) -> int | None:
    return layer_of(name)


def layer_problems(root: Path = ROOT) -> Iterator[str]:
    """Every engine and gateway module sits in a layer of its package, and imports nothing
    from a higher one."""
    for package, layers in LAYERS.items():
        known = modules(root, (package,))
        for name, m in sorted(known.items()):
            own = layer_of(name, layers, package)
            if own is None:
                yield (f"{name} is in none of tools/layout.py's {package.upper()}_LAYERS: add it "
                       "to one")
                continue
            for target in sorted(imports(m, known)):
                other = layer_of(target, layers, package)
                if other is not None and other > own:
                    yield (f"{name} ({layers[own][0]}) imports {target} "
                           f"({layers[other][0]}), a higher layer")


def problems(root: Path = ROOT) -> list[str]:
    return [*import_problems(root), *size_problems(root), *test_import_problems(root),
            *readme_problems(root), *config_json_problems(root), *probe_problems(root),
            *layer_problems(root)]


if __name__ == "__main__":
    found = problems()
    print("\n".join(found) or "layout: no problems")
    sys.exit(1 if found else 0)
