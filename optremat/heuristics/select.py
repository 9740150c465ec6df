"""What the keep-set heuristics share: which tensors are candidates, and picking the
cheapest candidate plan that fits."""

from __future__ import annotations

from typing import Iterable

import numpy as np

from optremat.core.budget import InfeasibleBudget
from optremat.core.graph import Graph
from optremat.core.schedule import Schedule, from_kept, simulate


def droppable(graph: Graph) -> np.ndarray:
    """Nodes a keep-set heuristic may choose not to keep: forward ops (every op when the
    graph marks no backward), never params, inputs or outputs."""
    return ~graph.backward & ~graph.pinned & ~graph.output


PER_STAGE_LIMIT = 300
"""Largest training graph on which keep sets are also lowered with per-stage recomputation:
it sometimes reaches lower peaks, but its cost grows with depth squared."""


def lowerings(graph: Graph, kept: np.ndarray) -> list[Schedule]:
    """The schedules a keep set can mean: recompute once per backward and reuse (training
    graphs), and recompute per stage (other graphs, and small training graphs)."""
    if not graph.backward.any():
        return [from_kept(graph, kept)]
    schedules = [from_kept(graph, kept, reuse=True)]
    if graph.n <= PER_STAGE_LIMIT:
        schedules.append(from_kept(graph, kept))
    return schedules


def cheapest_fitting(graph: Graph, budget: int, keep_sets: Iterable[np.ndarray], planner: str) -> Schedule:
    """The cheapest lowering of any keep set whose simulated peak fits `budget`; raises
    InfeasibleBudget naming the smallest peak any of them reached."""
    best: tuple[float, Schedule] | None = None
    smallest = None
    for kept in keep_sets:
        for schedule in lowerings(graph, kept):
            result = simulate(graph, schedule)
            smallest = result.peak_bytes if smallest is None else min(smallest, result.peak_bytes)
            if result.peak_bytes <= budget and (best is None or result.cost < best[0]):
                best = (result.cost, schedule)
    if best is None:
        raise InfeasibleBudget(budget, int(smallest or 0), planner)
    return best[1]
