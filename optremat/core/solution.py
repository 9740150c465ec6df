"""What a planner returns: a schedule plus the solver's own account of how good it is."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from optremat.core.schedule import Schedule

OPTIMAL = "OPTIMAL"
FEASIBLE = "FEASIBLE"
HEURISTIC = "HEURISTIC"

Progress = Callable[[float, float, float], None]
"""Called with (elapsed seconds, incumbent cost, proven lower bound) as a solve improves."""


@dataclass(frozen=True, eq=False)
class Solution:
    """A schedule and its provenance.

    `status` is OPTIMAL only when the solver proved it; FEASIBLE when it stopped (time
    limit) with a plan and `lower_bound` on the total cost; HEURISTIC for planners that
    prove nothing. `cost` is the schedule's total cost as simulated. For the interval
    model the proof is relative to `copies` (each node computed at most that many times).
    `shared` maps each computation (an index into the schedule's events) that writes over
    an input's storage to that input, as `SimResult.shared` does; `cost` and the plan's
    peak are priced with those shares.
    """

    schedule: Schedule
    solver: str
    status: str
    cost: float
    lower_bound: float | None
    seconds: float
    copies: int | None = None
    shared: dict[int, int] = field(default_factory=dict)

    @property
    def gap(self) -> float | None:
        """(cost - lower bound) / cost, or None when nothing is proven."""
        if self.lower_bound is None:
            return None
        return max(0.0, self.cost - self.lower_bound) / self.cost if self.cost > 0 else 0.0
