"""Greedy by benefit: drop the tensors that free the most bytes per second of
recomputation until the plan fits (the knapsack view behind PyTorch's
`activation_memory_budget`).

As in PyTorch's partitioner, a dropped tensor is recomputed just before each use from
tensors that are kept, never from other dropped ones, so recomputation stays one op deep.
"""

from __future__ import annotations

import numpy as np

from optremat.core.budget import InfeasibleBudget
from optremat.core.graph import Graph
from optremat.core.schedule import Schedule, from_kept, simulate
from optremat.heuristics.select import droppable


def drop_order(graph: Graph) -> np.ndarray:
    """Droppable tensors by bytes per recompute-second, skipping any whose input or
    consumer is already dropped."""
    candidates = np.nonzero(droppable(graph) & (graph.size > 0))[0]
    ratio = graph.size[candidates] / np.maximum(graph.cost[candidates], 1e-12 * max(graph.total_cost, 1e-30))
    dropped = np.zeros(graph.n, dtype=bool)
    order = []
    for v in candidates[np.argsort(-ratio, kind="stable")].tolist():
        if not dropped[graph.preds[v]].any() and not dropped[graph.succs[v]].any():
            dropped[v] = True
            order.append(v)
    return np.array(order, dtype=np.int64)


def greedy_benefit(graph: Graph, budget: int) -> Schedule:
    """Drop the shortest prefix of `drop_order` that fits (binary search: the peak falls,
    though not strictly, as more is dropped)."""
    order = drop_order(graph)

    def plan(count: int) -> tuple[Schedule, int]:
        kept = np.ones(graph.n, dtype=bool)
        kept[order[:count]] = False
        schedule = from_kept(graph, kept)
        return schedule, simulate(graph, schedule).peak_bytes

    best, peak = plan(len(order))
    if peak > budget:
        raise InfeasibleBudget(budget, peak, "benefit")
    lo, hi = 0, len(order)
    while lo < hi:
        mid = (lo + hi) // 2
        schedule, peak = plan(mid)
        if peak <= budget:
            best, hi = schedule, mid
        else:
            lo = mid + 1
    return best
