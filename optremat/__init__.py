"""optremat: plans activation rematerialization (keep / recompute) for PyTorch training."""

from optremat.budget import InfeasibleBudget, resolve_budget
from optremat.extract import ExtractionError, extract
from optremat.graph import Graph, GraphError
from optremat.plan import Plan, plan
from optremat.regions import Region
from optremat.runtime.apply import Planned, apply, remove
from optremat.runtime.native import PlanMismatch
from optremat.schedule import (InvalidSchedule, Schedule, SimResult, from_computations, from_kept, keep_all,
                               recompute_all, simulate)
from optremat.solution import Solution
from optremat.solve import SOLVERS, solve

__version__ = "0.1.0"

__all__ = [
    "ExtractionError",
    "Graph",
    "GraphError",
    "InfeasibleBudget",
    "InvalidSchedule",
    "Plan",
    "PlanMismatch",
    "Planned",
    "Region",
    "Schedule",
    "SOLVERS",
    "SimResult",
    "Solution",
    "apply",
    "extract",
    "from_computations",
    "from_kept",
    "keep_all",
    "plan",
    "recompute_all",
    "remove",
    "resolve_budget",
    "simulate",
    "solve",
]
