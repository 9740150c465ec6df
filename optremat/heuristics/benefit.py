"""Greedy by benefit: drop the tensors that free the most bytes per second of
recomputation until the plan fits (the knapsack view behind PyTorch's
`activation_memory_budget`)."""

from __future__ import annotations

import numpy as np

from optremat.budget import InfeasibleBudget
from optremat.graph import Graph
from optremat.heuristics.select import cheapest_fitting, droppable
from optremat.schedule import Schedule


def greedy_benefit(graph: Graph, budget: int) -> Schedule:
    """Rank droppable tensors by size / cost and drop the shortest prefix of the ranking
    that fits (binary search: the peak falls, though not strictly, as more is dropped)."""
    candidates = np.nonzero(droppable(graph) & (graph.size > 0))[0]
    ratio = graph.size[candidates] / np.maximum(graph.cost[candidates], 1e-12 * max(graph.total_cost, 1e-30))
    ranked = candidates[np.argsort(-ratio, kind="stable")]

    def keep_set(count: int) -> np.ndarray:
        kept = np.ones(graph.n, dtype=bool)
        kept[ranked[:count]] = False
        return kept

    def fitting(count: int) -> Schedule | None:
        try:
            return cheapest_fitting(graph, budget, [keep_set(count)], "benefit")
        except InfeasibleBudget:
            return None

    lo, hi = 0, len(ranked)
    best = fitting(hi)
    if best is None:
        return cheapest_fitting(graph, budget, [keep_set(0), keep_set(hi)], "benefit")
    while lo < hi:
        mid = (lo + hi) // 2
        schedule = fitting(mid)
        if schedule is None:
            lo = mid + 1
        else:
            best, hi = schedule, mid
    return best
