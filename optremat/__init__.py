"""optremat: plans activation rematerialization (keep / recompute) for PyTorch training.

The graph level (`optremat.graph`, `schedule`, `solve`, the published graphs) needs no
torch, so importing the package does not import it: the names that need torch (`plan`,
`apply`, `extract`, ...) are imported on first use.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_ON_FIRST_USE = {
    "ExtractionError": "optremat.extract", "extract": "optremat.extract", "Inputs": "optremat.inputs",
    "Plan": "optremat.plan", "PlanFileError": "optremat.plan", "plan": "optremat.planning",
    "price_regions": "optremat.native_plan", "reprice": "optremat.native_plan",
    "apply": "optremat.runtime.apply", "Replanning": "optremat.runtime.apply", "remove": "optremat.runtime.apply",
    "PlanMismatch": "optremat.runtime.native",
    "compile_backend": "optremat.compiler.backend", "KnapsackSolver": "optremat.compiler.knapsack",
}
"""Exported names and the modules that hold them, imported when first asked for."""
_FUNCTIONS = ("extract", "plan", "solve")
"""Exported functions named like the submodules that hold them."""


class _Package(types.ModuleType):
    """The package module: a submodule named like a function (`optremat.plan`) does not
    replace that function as an attribute when the submodule is imported."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FUNCTIONS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        if name not in _ON_FIRST_USE:
            raise AttributeError(f"module 'optremat' has no attribute {name!r}")
        value = getattr(importlib.import_module(_ON_FIRST_USE[name]), name)
        super().__setattr__(name, value)
        return value

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(_ON_FIRST_USE))


sys.modules[__name__].__class__ = _Package

from optremat.budget import InfeasibleBudget, resolve_budget  # noqa: E402 - after the class swap
from optremat.graph import Graph, GraphError
from optremat.regions import Region
from optremat.sharding import DDP, FSDP
from optremat.schedule import (InvalidSchedule, Schedule, SimResult, from_computations, from_kept, keep_all,
                               recompute_all, simulate)
from optremat.solution import Solution
from optremat.solve import SOLVERS, solve

__version__ = "0.1.0"

__all__ = [
    "DDP",
    "ExtractionError",
    "FSDP",
    "Graph",
    "GraphError",
    "InfeasibleBudget",
    "Inputs",
    "InvalidSchedule",
    "KnapsackSolver",
    "Plan",
    "PlanFileError",
    "PlanMismatch",
    "Region",
    "Replanning",
    "Schedule",
    "SOLVERS",
    "SimResult",
    "Solution",
    "apply",
    "compile_backend",
    "extract",
    "from_computations",
    "from_kept",
    "keep_all",
    "plan",
    "price_regions",
    "recompute_all",
    "remove",
    "reprice",
    "resolve_budget",
    "simulate",
    "solve",
]
