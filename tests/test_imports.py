"""Imports in llmtrain/ and kernels/ run one way: no cycles, and no module imports from a layer above its own.

The graph is read from the source with `ast` (nothing is imported, so this runs in a fraction of a second).
Every import statement counts, wherever it stands: at the top of a module, inside a function (a lazy
import) or under `if TYPE_CHECKING:`. `from pkg import name` imports the submodule `pkg.name` when there is
one, else the package `pkg` itself; a package's `__init__` imports what it re-exports.

Layers, low to high (a module may import from its own layer and the ones below):
  0  llmtrain.config and the leaf modules every layer shares (llmtrain.errors, .faults, .precision,
     .launch_env)
  1  kernels, llmtrain.models, llmtrain.data (kernels imports no llmtrain module at all)
  2  llmtrain.parallel
  3  llmtrain.pipeline
  4  llmtrain.checkpoint, llmtrain.planner
  5  llmtrain.training
  6  the front ends: llmtrain.sweep (launches training runs), llmtrain.cli (what the tools share) and the
     llmtrain package's own __init__ (its from_pretrained loads models and checkpoints)
A new module directly under llmtrain/ needs its own entry in LAYERS (the package's entry is its __init__'s).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("llmtrain", "kernels")

# A module's layer is that of the longest prefix listed, except that "llmtrain" stands for its __init__ only.
LAYERS = {
    "llmtrain.config": 0,
    "llmtrain.errors": 0,
    "llmtrain.faults": 0,
    "llmtrain.precision": 0,
    "llmtrain.launch_env": 0,
    "kernels": 1,
    "llmtrain.models": 1,
    "llmtrain.data": 1,
    "llmtrain.parallel": 2,
    "llmtrain.pipeline": 3,
    "llmtrain.checkpoint": 4,
    "llmtrain.planner": 4,
    "llmtrain.training": 5,
    "llmtrain.sweep": 6,
    "llmtrain.cli": 6,
    "llmtrain": 6,
}
# Packages that may import nothing outside themselves (but the standard library, torch and triton).
SELF_CONTAINED = ("kernels",)


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module under root/<package>, by dotted name (a package is named by its __init__.py)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The module `name` loads: itself if it is one of ours, else its longest prefix that is; None if none."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The absolute dotted names an import statement may load (for `from m import n`: m.n, then m)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def _import_statements(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in `body` and the statement blocks nested in it (functions, classes, if,
    try, with, loops); expressions hold no statements, so they are not walked (that keeps this fast)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            block = getattr(node, field, None)
            if block:
                yield from _import_statements(block)


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports (anywhere in its source)."""
    modules = module_files(root, packages)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        imported: set[str] = set()
        for node in _import_statements(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                found = {_known(name, modules) for name in _imported_names(node, module, is_package)}
            else:
                *submodules, base = _imported_names(node, module, is_package)
                found = {name for name in submodules if name in modules}
                # A name that is no submodule is an attribute of the package (or module) `base`.
                if len(found) < len(submodules):
                    found.add(_known(base, modules))
            imported.update(name for name in found if name)
        imported.discard(module)
        graph[module] = imported
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (its modules in import order, the first repeated at the end) per strongly connected
    component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                connect(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            connect(module)
    return [_cycle_through(component, graph) for component in components]


def _cycle_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle from the component's first module back to it (breadth-first inside the component)."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        next_frontier = []
        for module in frontier:
            for target in sorted(graph[module] & members):
                if target == start:
                    path = [start]
                    while module != start:
                        path.append(module)
                        module = came_from[module]
                    return [start, *reversed(path[1:]), start]
                if target not in came_from:
                    came_from[target] = module
                    next_frontier.append(target)
        frontier = next_frontier
    raise AssertionError(f"{component} is no cycle")


def layer_of(module: str, layers: dict[str, int] = LAYERS) -> tuple[str, int]:
    """The layer table entry a module falls under: (its prefix, its layer)."""
    name = module
    while name not in layers or (name == "llmtrain" and module != "llmtrain"):
        if "." not in name:
            raise KeyError(f"{module} is in no layer: add it to LAYERS in {__file__}")
        name = name.rpartition(".")[0]
    return name, layers[name]


def wrong_way_imports(
    graph: dict[str, set[str]],
    layers: dict[str, int] = LAYERS,
    self_contained: tuple[str, ...] = SELF_CONTAINED,
) -> list[str]:
    """A line for each import from a higher layer, or out of a self-contained package."""
    problems = []
    for importer in sorted(graph):
        importer_group, importer_layer = layer_of(importer, layers)
        for imported in sorted(graph[importer]):
            imported_group, imported_layer = layer_of(imported, layers)
            if imported_layer > importer_layer:
                problems.append(
                    f"{importer} (layer {importer_layer}, {importer_group}) imports {imported} "
                    f"(layer {imported_layer}, {imported_group})"
                )
            elif importer_group in self_contained and imported_group != importer_group:
                problems.append(
                    f"{importer} ({importer_group} imports nothing outside it) imports {imported}"
                )
    return problems


def test_no_import_cycles():
    cycles = find_cycles(import_graph(ROOT))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_no_import_from_a_higher_layer():
    problems = wrong_way_imports(import_graph(ROOT))
    assert not problems, "imports from a higher layer:\n" + "\n".join(problems)


def test_every_module_has_a_layer():
    for module in module_files(ROOT, PACKAGES):
        layer_of(module)


def test_the_checker_finds_a_cycle_and_a_wrong_way_import(tmp_path):
    files = {
        "low/__init__.py": "from low.a import A\n",
        "low/a.py": "def f():\n    from . import b\n",
        "low/b.py": "from .a import A\nimport high.top\n",
        "high/__init__.py": "",
        "high/top.py": "from low import a\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("low", "high"))
    assert graph == {
        "low": {"low.a"},
        "low.a": {"low.b"},
        "low.b": {"low.a", "high.top"},
        "high": set(),
        "high.top": {"low.a"},
    }
    assert find_cycles(graph) == [["high.top", "low.a", "low.b", "high.top"]]
    assert wrong_way_imports(graph, {"low": 0, "high": 1}, ()) == [
        "low.b (layer 0, low) imports high.top (layer 1, high)"
    ]
