"""Backward mirroring after MXNet (the memory-optimisation pass with its benefit check).

A forward tensor no backward op reads is never stored for the backward: it sits on the
mirror path for free (a fully-connected layer's output, whose gradient needs only the
layer's input). A tensor the backward does read is mirrored, recomputed instead of
stored, only when that is cheap and truly saves memory: its recomputation must not
need inputs that would otherwise be gone and together outweigh it (an RNN cell whose
recomputation keeps its gate inputs alive is not mirrored).
"""

from __future__ import annotations

import math

import numpy as np

from optremat.core.graph import Graph
from optremat.core.schedule import Schedule
from optremat.heuristics.select import cheapest_fitting, droppable


def _saved(graph: Graph) -> np.ndarray:
    """Tensors the backward reads (every tensor with a reader when no node is backward)."""
    saved = np.zeros(graph.n, dtype=bool)
    for src, dst in graph.edges.tolist():
        saved[src] |= bool(graph.backward[dst]) or not graph.backward.any()
    return saved


def mirror_path(graph: Graph, max_cost: float = math.inf) -> np.ndarray:
    """Nodes recomputed in the backward instead of stored: every unsaved forward tensor,
    and each saved one whose recomputation (with the mirrored inputs it needs) costs at
    most `max_cost` and whose unsaved inputs are smaller than it."""
    forward = droppable(graph)
    saved = _saved(graph)
    path = forward & ~saved
    recompute = graph.cost.astype(float).copy()
    for v in range(graph.n):
        mirrored_inputs = [p for p in graph.preds[v].tolist() if path[p]]
        recompute[v] += sum(recompute[p] for p in mirrored_inputs)
        if forward[v] and saved[v]:
            held = sum(int(graph.size[p]) for p in mirrored_inputs)
            path[v] = recompute[v] <= max_cost and int(graph.size[v]) > held
    return path


def mirror(graph: Graph, budget: int, thresholds: int = 10) -> Schedule:
    """Mirroring with the recompute-cost cap swept over quantiles of the node costs; the
    cheapest plan that fits wins."""
    costs = graph.cost[droppable(graph)]
    caps = np.unique(np.quantile(costs, np.linspace(0, 1, thresholds))) if len(costs) else np.array([0.0])
    caps = np.concatenate([[-1.0], caps, [math.inf]])
    return cheapest_fitting(graph, budget, [~mirror_path(graph, cap) for cap in caps], "mirror")
