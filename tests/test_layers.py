"""The layer rules of the README's package layout, read from the source: no import cycles, no arrow
pointing up.

Every ``import`` statement counts, function-local and ``TYPE_CHECKING`` ones included. An import of
``pkg.mod`` (or ``from pkg import mod``) is an edge to that module; the implicit import of the
parent package's ``__init__`` is not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> import name (kernels/ installs as mcore_engine_kernels, see setup.py).
PACKAGES = {"mcore_engine": "mcore_engine", "kernels": "mcore_engine_kernels"}


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, name in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base
                           for alias in node.names]
            for target in targets:
                while target and target not in mods:  # `import a.b.c` of a non-module attribute
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = _import_graph()
    cycles = _cycles(graph)
    detail = "; ".join(
        " <-> ".join(c) + " [" + ", ".join(f"{a}->{b}" for a in c for b in sorted(graph[a]) if b in c) + "]"
        for c in cycles)
    assert not cycles, f"modules that import each other (directly or through others): {detail}"


def test_kernels_never_import_the_package_above():
    graph = _import_graph()
    up = sorted(f"{a} -> {b}" for a, deps in graph.items() if a.startswith("mcore_engine_kernels")
                for b in deps if not b.startswith("mcore_engine_kernels"))
    assert not up, f"kernels/ imports from mcore_engine/: {up}"


def test_ops_do_not_import_the_engine_layers():
    """ops/ uses torch (and Megatron-Core only to find the default TP group), never the engine."""
    graph = _import_graph()
    allowed = ("mcore_engine.ops", "mcore_engine_kernels")
    up = sorted(f"{a} -> {b}" for a, deps in graph.items() if a.startswith("mcore_engine.ops")
                for b in deps if not b.startswith(allowed))
    assert not up, f"ops/ imports from higher layers: {up}"


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_layers_know_nothing_of_the_engine():
    """layers/ holds nn modules swapped into Megatron's spec: torch, Megatron-Core, ops/ and the
    config blocks' constants only."""
    graph = _import_graph()
    allowed = ("mcore_engine.layers", "mcore_engine.ops", "mcore_engine.config", "mcore_engine_kernels")
    up = sorted(f"{a} -> {b}" for a, deps in graph.items() if a.startswith("mcore_engine.layers")
                for b in deps if not b.startswith(allowed))
    assert not up, f"layers/ imports from higher layers: {up}"


# The subsystems of the package layout, bottom (0) to top: a module imports its own subsystem or lower ones.
LEVELS = {
    "config": 0, "ops": 0,
    "layers": 1,
    "parallel": 2, "data": 2, "hf": 2, "processor": 2, "losses": 2,
    "model": 3,
    "step": 4,
    "state": 5, "weight_sync": 5,
    "engine": 6,
    "integrations": 7, "recipes": 7, "": 7,  # "": the package's __init__ (its faces load lazily)
}


def _subsystem(module: str) -> str | None:
    parts = module.split(".")
    return (parts[1] if len(parts) > 1 else "") if parts[0] == "mcore_engine" else None


def test_arrows_point_down():
    graph = _import_graph()
    assert {_subsystem(m) for m in graph} - {None} <= LEVELS.keys(), "a new subsystem needs a level"
    up = sorted(f"{a} -> {b}" for a, deps in graph.items() if _subsystem(a) is not None
                for b in deps if _subsystem(b) is not None and LEVELS[_subsystem(b)] > LEVELS[_subsystem(a)])
    assert not up, f"imports that point up the layers: {up}"


def test_only_integrations_import_a_framework():
    """The core never imports an RL framework (verl); an adapter in ``integrations/`` does."""
    found = []
    for mod, path in _modules().items():
        if mod.startswith("mcore_engine.integrations"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{mod} -> {n}" for n in names if n.split(".")[0] in FRAMEWORKS]
    assert not found, f"the core imports a framework: {found}"


FRAMEWORKS = ("verl", "nemo_rl", "slime", "skyrl", "tinker", "openrlhf")
