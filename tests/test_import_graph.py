"""The import graph of k3serve: no cycles, and every import points down the floors (docs/architecture.md):

    base < weights < model < stream < loading < engine < serve < cluster < sim < training < lab < cli

`base` is the top-level leaf modules (config, errors, units, the tokenizers, default_model, host); `loading` is the
one composition root (the architecture registry and `load_model`). Every import counts, at module level, inside
functions (lazy) and under TYPE_CHECKING alike, since each is a dependency of one module on another."""

from __future__ import annotations

import ast
from pathlib import Path

import k3serve

ROOT = Path(k3serve.__file__).parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def import_graph() -> dict[str, set[str]]:
    """module -> the k3serve modules it imports (`from pkg import submodule` counts as the submodule only)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = _package_of(name, path).split(".")
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_the_finder_sees_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


FLOORS = ("base", "weights", "model", "stream", "loading", "engine", "serve", "cluster", "sim", "training", "lab",
          "cli")


def floor_of(module: str) -> str:
    """k3serve.<package>.* -> its package's floor; a top-level module (k3serve.<module>) is base."""
    parts = module.split(".")
    if len(parts) == 1:
        return "base"
    if parts[1] in FLOORS:
        return parts[1]
    assert (ROOT / f"{parts[1]}.py").exists(), f"{module}: a package with no floor; add it to FLOORS"
    return "base"


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where the imported module sits on a higher floor than its importer."""
    return [(m, d) for m, deps in sorted(graph.items()) for d in sorted(deps)
            if FLOORS.index(floor_of(d)) > FLOORS.index(floor_of(m))]


def test_the_floor_check_sees_an_upward_import():
    graph = {"k3serve.model.k3": {"k3serve.engine.engine", "k3serve.weights.store"}, "k3serve.config": set()}
    assert upward_imports(graph) == [("k3serve.model.k3", "k3serve.engine.engine")]
    assert floor_of("k3serve.config") == "base" and floor_of("k3serve.cli.main") == "cli"


def test_every_import_points_down_the_floors():
    graph = import_graph()
    assert {floor_of(m) for m in graph} == set(FLOORS)  # every floor exists, and no package is left out
    assert upward_imports(graph) == []


def test_k3serve_has_no_import_cycles():
    graph = import_graph()
    assert "k3serve.engine.engine" in graph and "k3serve.engine.scheduler" in graph["k3serve.engine.engine"]
    assert find_cycles(graph) == []
