"""optremat: plans activation rematerialization (keep / recompute) for PyTorch training."""

from optremat.budget import InfeasibleBudget, resolve_budget
from optremat.extract import ExtractionError, extract
from optremat.graph import Graph, GraphError
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
    "Schedule",
    "SOLVERS",
    "SimResult",
    "Solution",
    "extract",
    "from_computations",
    "from_kept",
    "keep_all",
    "recompute_all",
    "resolve_budget",
    "simulate",
    "solve",
]
