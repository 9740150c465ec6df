"""optremat: plans activation rematerialization (keep / recompute) for PyTorch training.

The torch-free core (`optremat.core`: the graph, the liveness engine, budgets) and the
planners over it (`optremat.planners`, `heuristics`, `ilp`) need no torch, so importing the
package does not import it: the names that need torch (`plan`, `apply`, `extract`, ...)
are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from optremat.core.budget import InfeasibleBudget, resolve_budget
from optremat.core.graph import Graph, GraphError
from optremat.core.schedule import (InvalidSchedule, Schedule, SimResult, from_computations, from_kept, keep_all,
                                    recompute_all, simulate)
from optremat.core.sharding import DDP, FSDP
from optremat.core.solution import Solution
from optremat.planners.regions import Region
from optremat.planners.solve import SOLVERS, solve

_ON_FIRST_USE = {
    "ExtractionError": "optremat.tracing.extract", "extract": "optremat.tracing.extract",
    "FakeTensorLeft": "optremat.tracing.leaks",
    "Inputs": "optremat.tracing.inputs", "CausalLMLoss": "optremat.tracing.lm_loss",
    "Plan": "optremat.planning.result", "PlanFileError": "optremat.planning.result", "plan": "optremat.planning.model",
    "price_regions": "optremat.planning.native", "reprice": "optremat.planning.native",
    "apply": "optremat.runtime.apply", "Replanning": "optremat.runtime.apply", "remove": "optremat.runtime.apply",
    "PlanMismatch": "optremat.runtime.native",
    "compile_backend": "optremat.compiler.backend", "KnapsackSolver": "optremat.compiler.knapsack",
    "compile_causal_lm": "optremat.compiler.causal_lm",
    "DeviceProfile": "optremat.tracing.costs", "measure_profile": "optremat.tracing.calibrate",
}
"""Exported names that need torch and the modules that hold them, imported when first asked for."""


def __getattr__(name: str) -> Any:
    if name not in _ON_FIRST_USE:
        raise AttributeError(f"module 'optremat' has no attribute {name!r}")
    value = getattr(importlib.import_module(_ON_FIRST_USE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ON_FIRST_USE))


__version__ = "0.1.0"

__all__ = [
    "CausalLMLoss",
    "DDP",
    "DeviceProfile",
    "ExtractionError",
    "FSDP",
    "FakeTensorLeft",
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
    "compile_causal_lm",
    "extract",
    "from_computations",
    "from_kept",
    "keep_all",
    "measure_profile",
    "plan",
    "price_regions",
    "recompute_all",
    "remove",
    "reprice",
    "resolve_budget",
    "simulate",
    "solve",
]
