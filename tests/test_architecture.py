"""The package's shape: the library never imports the experiments (or the CLI), and no module
imports itself round a cycle, lazily or not. Read from the source with ``ast``: every import
statement counts, at the top of a module or inside a function."""

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "diff_transformer"
TOP_LAYERS = ("diff_transformer.experiments", "diff_transformer.cli", "diff_transformer.__main__")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports anywhere (``from X import name`` counts X.name when that
    is a module, else X)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
            # ``from . import submodule`` imports the submodule, not what the package itself defines
            targets = submodules + ([base] if len(submodules) < len(node.names) else [])
        else:
            continue
        found.update(t for t in targets if t in modules)
    return found - {name}


@functools.cache
def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: imported_modules(path, modules) for name, path in paths.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_library_never_imports_the_experiments_or_the_cli():
    offending = {name: sorted(t for t in targets if t.startswith(TOP_LAYERS))
                 for name, targets in graph().items() if not name.startswith(TOP_LAYERS)}
    assert {name: targets for name, targets in offending.items() if targets} == {}


def test_no_module_of_the_package_imports_itself_round_a_cycle():
    assert cycles(graph()) == []


def test_the_checks_see_a_planted_cycle_and_a_planted_upward_import():
    """The two checks above on a planted graph: they must not pass by looking at nothing."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    edges = graph()
    assert "diff_transformer.experiments.config" in edges["diff_transformer.experiments.compare"]
    assert "diff_transformer.train.step" in edges["diff_transformer.train.trainer"]  # a relative import
    assert "diff_transformer.experiments.compare" in edges["diff_transformer.cli.train"]  # a lazy one


@pytest.mark.parametrize("module", ["diff_transformer.train.config", "diff_transformer.train.trainer"])
def test_the_trainer_config_imports_nothing_above_the_trainer(module):
    above = ("diff_transformer.experiments", "diff_transformer.evaluation", "diff_transformer.paper",
             "diff_transformer.cli", "diff_transformer.bench")
    assert sorted(t for t in graph()[module] if t.startswith(above)) == []
