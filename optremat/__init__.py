"""optremat: plans activation rematerialization (keep / recompute) for PyTorch training."""

from optremat.extract import ExtractionError, extract
from optremat.graph import Graph, GraphError
from optremat.schedule import InvalidSchedule, Schedule, SimResult, from_kept, keep_all, recompute_all, simulate

__version__ = "0.1.0"

__all__ = [
    "ExtractionError",
    "Graph",
    "GraphError",
    "InvalidSchedule",
    "Schedule",
    "SimResult",
    "extract",
    "from_kept",
    "keep_all",
    "recompute_all",
    "simulate",
]
