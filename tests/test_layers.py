"""The package's layers point one way, and the graph level runs without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "optremat"

LAYERS = (
    {"core"},
    {"heuristics", "ilp", "planners"},
    {"tracing", "planning", "models"},
    {"runtime", "compiler", "distributed", "integrations"},
    {"bench", "cli", "plots"},
)
"""Bottom to top: the graph IR and its simulation; the planners; plans (tracing models,
budgets, the cache); what runs plans (eagerly, as torch.compile's partition, or on every
rank of a data-parallel job); the command line and benchmark front ends. A module
imports from its own layer or the ones below."""

TORCH_FREE = 2
"""The layers below this one import no torch."""


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name, without the `optremat.` prefix."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            found[".".join(parts)] = path
    return found


def imports(path: Path) -> set[str]:
    """Top-level module names each import in `path` names, wherever in the file it stands."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module.split(".")[0] == "optremat":
                names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def layer(name: str) -> int:
    top = name.split(".")[0]
    matches = [i for i, members in enumerate(LAYERS) if top in members]
    assert matches, f"optremat.{name} is in no layer: add it to LAYERS"
    return matches[0]


def internal(path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `path` imports."""
    return {name.removeprefix("optremat.") for name in imports(path)
            if name.startswith("optremat.") and name.removeprefix("optremat.") in known}


def test_every_import_points_down_or_sideways() -> None:
    known = modules()
    upward = [f"optremat.{name} (layer {layer(name)}) imports optremat.{other} (layer {layer(other)})"
              for name, path in known.items() for other in internal(path, known) if layer(other) > layer(name)]
    assert not upward, "\n".join(upward)


def test_modules_import_one_another_without_cycles() -> None:
    known = modules()
    graph = nx.DiGraph((name, other) for name, path in known.items() for other in internal(path, known)
                       if other != name and not name.startswith(f"{other}."))
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, cycles


def test_the_graph_and_planner_layers_import_no_torch() -> None:
    heavy = [f"optremat.{name}" for name, path in modules().items()
             if layer(name) < TORCH_FREE and any(n.split(".")[0] == "torch" for n in imports(path))]
    assert not heavy, heavy


def test_the_graph_level_imports_without_torch() -> None:
    """`import optremat` and the graph, planner and published-graph modules leave torch
    unloaded; the names that need it load it on first use."""
    code = ("import sys, optremat, optremat.core.graph, optremat.core.published, optremat.planners.solve, "
            "optremat.planners.regions, optremat.heuristics, optremat.ilp.cpsat\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "optremat.plan\n"
            "assert 'torch' in sys.modules and callable(optremat.plan) and callable(optremat.extract)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_no_two_top_level_names_differ_only_by_plan() -> None:
    """A reader tells the top-level modules and packages apart by name: none is another
    with "plan" (or "planning") added before or after."""
    names = {path.stem if path.is_file() else path.name for path in PACKAGE.iterdir()
             if (path.suffix == ".py" or (path / "__init__.py").exists()) and path.stem != "__init__"}
    stripped = {}
    for name in names:
        bare = name
        for affix in ("planning", "plan"):
            bare = bare.removeprefix(affix).removesuffix(affix).strip("_")
        stripped.setdefault(bare, set()).add(name)
    clashes = [sorted(group) for group in stripped.values() if len(group) > 1]
    assert not clashes, clashes
