"""Memory budgets: what users may write, and the error for one that cannot be met."""

from __future__ import annotations

import math
import re

from optremat.graph import Graph, format_bytes
from optremat.schedule import keep_all, simulate

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
ACCEPTED = "a budget is an int of bytes, a size such as '6GiB' or '500MB', or a fraction in (0, 1] of the unplanned peak"


class InfeasibleBudget(ValueError):
    """No plan fits `budget` bytes; `smallest` is the least peak known to be achievable.

    `proven` says whether `smallest` is proven minimal (by an exact solver, within the
    plans `scope` describes) or only the best a planner reached.
    """

    def __init__(self, budget: int, smallest: int, planner: str, proven: bool = False, scope: str = "") -> None:
        how = f"smallest feasible budget{scope}" if proven else f"smallest budget {planner} reaches"
        super().__init__(f"budget {format_bytes(budget)} is infeasible for {planner}; "
                         f"{how}: {format_bytes(smallest)} ({smallest} bytes)")
        self.budget = budget
        self.smallest = smallest
        self.planner = planner
        self.proven = proven


def parse_size(text: str) -> int:
    """Bytes meant by a size: digits, or a number with a unit such as "16GiB" or "500MB"."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not match or match.group(2) not in _UNITS or float(match.group(1)) * _UNITS[match.group(2)] < 1:
        raise ValueError(f"memory size {text!r} is not understood; give bytes or a size such as '16GiB' or '500MB'")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def resolve_budget(graph: Graph, budget: int | float | str) -> int:
    """Bytes meant by `budget` on `graph` (a fraction is of the unplanned simulated peak)."""
    value = check_budget(budget)
    if isinstance(value, float):
        return math.ceil(value * simulate(graph, keep_all(graph)).peak_bytes)
    return value


def check_budget(budget: int | float | str) -> int | float:
    """`budget` as bytes (an int) or a fraction of the unplanned peak (a float in (0, 1]);
    ValueError for anything else."""
    if isinstance(budget, bool):
        raise ValueError(f"budget {budget!r} is not understood; {ACCEPTED}")
    if isinstance(budget, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", budget.lower())
        if not match or match.group(2) not in _UNITS:
            raise ValueError(f"budget {budget!r} is not understood; {ACCEPTED}")
        value = float(match.group(1)) * _UNITS[match.group(2)]
        if match.group(2) == "" and value <= 1:
            return check_budget(value)
        budget = int(value)
    if isinstance(budget, float):
        if not math.isfinite(budget) or not 0 < budget <= 1:
            raise ValueError(f"budget {budget!r} is not understood; {ACCEPTED}")
        return budget
    if not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget {budget!r} is not understood; {ACCEPTED}")
    return budget
