"""Chen et al. 2016 ("Training deep nets with sublinear memory cost"): keep only segment
boundaries of the forward pass and recompute each segment in the backward.

Segment boundaries must be cut points, forward nodes no forward edge jumps over, so
that a segment's recomputation needs nothing but its boundary.
"""

from __future__ import annotations

import math

import numpy as np

from optremat.core.graph import Graph
from optremat.core.schedule import Schedule
from optremat.heuristics.select import cheapest_fitting, droppable


def cut_points(graph: Graph) -> np.ndarray:
    """Forward nodes v such that no edge between forward nodes runs from before v to after v."""
    forward = droppable(graph)
    src, dst = graph.edges[:, 0], graph.edges[:, 1]
    inner = forward[src] & forward[dst]
    cover = np.zeros(graph.n + 1, dtype=np.int64)
    np.add.at(cover, src[inner] + 1, 1)
    np.add.at(cover, dst[inner], -1)
    spanned = np.cumsum(cover)[:graph.n] > 0
    return np.nonzero(forward & ~spanned)[0]


def _kept(graph: Graph, checkpoints: np.ndarray) -> np.ndarray:
    kept = ~droppable(graph)
    kept[checkpoints] = True
    return kept


def chen_sqrt(graph: Graph, budget: int) -> Schedule:
    """Keep every ⌈√k⌉-th of the k cut points."""
    cuts = cut_points(graph)
    step = max(1, math.ceil(math.sqrt(len(cuts))))
    return cheapest_fitting(graph, budget, [_kept(graph, cuts[step - 1::step])], "chen")


def chen_greedy(graph: Graph, budget: int, thresholds: int = 10) -> Schedule:
    """Walk the forward pass and close a segment at the first cut point after its bytes
    pass a threshold; the threshold is swept geometrically and the cheapest fitting plan wins."""
    cuts = cut_points(graph)
    forward_bytes = np.where(droppable(graph), graph.size, 0)
    total = int(forward_bytes.sum())
    if total == 0 or not len(cuts):
        return cheapest_fitting(graph, budget, [_kept(graph, cuts)], "greedy")
    smallest = max(int(forward_bytes[forward_bytes > 0].min()), 1)
    keep_sets = []
    for threshold in np.geomspace(smallest, total, thresholds):
        since, chosen, start = 0, [], 0
        for cut in cuts.tolist():
            since += int(forward_bytes[start:cut + 1].sum())
            start = cut + 1
            if since >= threshold:
                chosen.append(cut)
                since = 0
        keep_sets.append(_kept(graph, np.array(chosen, dtype=np.int64)))
    return cheapest_fitting(graph, budget, keep_sets, "greedy")
