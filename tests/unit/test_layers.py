"""The package layers (trl_aspo/__init__.py, docs/api.md): imports point down only, no module imports itself back
through others, build-time code stays out of the runtime package, and no layer below the trainers reaches into a
trainer's privates. Read from the source with `ast`, so lazy imports inside functions count too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "trl_aspo"

# What each layer may import besides itself.
ALLOWED = {
    "algorithms": set(),
    "values": {"algorithms"},
    "config": {"algorithms", "values"},
    "builtin": set(),
    "evaluation": {"algorithms", "values", "builtin"},
    "infra": {"algorithms", "values", "config", "builtin"},
    "trainers": {"algorithms", "values", "config", "builtin", "evaluation", "infra"},
    "cli": {"algorithms", "values", "config", "builtin", "evaluation", "infra", "trainers"},
}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """The trl_aspo modules `path` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trl_aspo"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("trl_aspo"))
    return {name for name in found if name in MODULES}


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def test_every_module_lives_in_a_layer():
    loose = [name for name in MODULES if _layer(name) is None and name != "trl_aspo"]
    assert loose == []


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_imports_point_down_only(layer):
    wrong = sorted(
        f"{module} imports {imported}"
        for module, imported_modules in GRAPH.items()
        if _layer(module) == layer
        for imported in imported_modules
        if _layer(imported) not in (layer, None) and _layer(imported) not in ALLOWED[layer]
    )
    assert wrong == []


def test_algorithms_and_values_know_no_trainer_cli_or_evaluation():
    for module, imported in GRAPH.items():
        if _layer(module) in ("algorithms", "values"):
            assert not {_layer(name) for name in imported} & {"trainers", "cli", "evaluation"}, module


def test_no_import_circle():
    state: dict[str, int] = {}
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for imported in sorted(GRAPH[module]):
            if state.get(imported) == 1:
                circles.append(" -> ".join([*path[path.index(imported) :], imported]))
            elif imported not in state:
                visit(imported, [*path, imported])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert circles == []


def test_build_time_code_is_outside_the_runtime_package():
    for module, path in MODULES.items():
        assert not re.search(r"^\s*(from|import) warmstart\b", path.read_text(), re.M), module
    assert not (PACKAGE / "builtin" / "warmstart.py").exists()


def test_nothing_below_a_trainer_reads_its_privates():
    for module, path in MODULES.items():
        if _layer(module) not in ("trainers", None):
            assert not re.search(r"\btrainer\._[a-z]", path.read_text()), module
