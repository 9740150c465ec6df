"""Lifetime splitting: cut the tensors that sit idle across the peak and recompute them
for their next reader, until the plan fits.

It needs no forward/backward structure, so it seeds the exact solvers on any DAG (the
published random layered graphs have none). Each step simulates the plan, finds the
stage with the highest peak, and among the tensors live across that stage but not read
in it picks those that free the most bytes per second of recomputation (its own bytes,
less those of its inputs that would have to live across the peak to recompute it
afterwards), best first, until they cover half the peak's excess over the budget
(halving keeps the simulations few without splitting much more than needed). Each is
then computed again in the stage of its next reader, so its first copy dies after its
last earlier read.
"""

from __future__ import annotations

import numpy as np

from optremat.core.budget import InfeasibleBudget
from optremat.core.graph import Graph
from optremat.core.schedule import Schedule, from_computations, simulate

MAX_STEPS = 40
"""Steps after which splitting gives up: plans that fit take fewer than 20 on the published
graphs, while chains can creep down a split at a time for hundreds."""


def split_lifetimes(graph: Graph, budget: int) -> Schedule:
    """The plan lifetime splitting reaches under `budget`; InfeasibleBudget (naming the
    least peak reached) when no split is left to try or MAX_STEPS did not reach it."""
    movable = ~(graph.pinned | graph.output) & (graph.alias_of < 0) & (graph.size > 0)
    computations: set[tuple[int, int]] = set()
    schedule = from_computations(graph, computations)
    result = simulate(graph, schedule)
    best, steps = result.peak_bytes, 0
    while result.peak_bytes > budget:
        moves = set(_best_splits(graph, schedule, int(np.argmax(result.stage_peak)), movable,
                                 (result.peak_bytes - budget) // 2 + 1)) - computations
        if not moves or steps == MAX_STEPS:
            raise InfeasibleBudget(budget, best, "split")
        computations |= moves
        schedule = from_computations(graph, computations)
        result = simulate(graph, schedule)
        steps += 1
        best = min(best, result.peak_bytes)
    return schedule


def _best_splits(graph: Graph, schedule: Schedule, peak: int, movable: np.ndarray,
                 excess: int) -> list[tuple[int, int]]:
    """(tensor, stage to recompute it in) pairs, best bytes freed at stage `peak` per
    second of recomputation first, freeing `excess` bytes there between them (fewer
    when fewer splits free anything)."""
    node, stage, until = schedule.node, schedule.stage, schedule.until
    across = (stage < peak) & (until > peak)
    live = np.zeros(graph.n, dtype=bool)
    live[node[across]] = True
    live |= graph.pinned | graph.output
    read_there = np.zeros(graph.n, dtype=bool)
    for c in node[stage == peak].tolist():
        read_there[graph.preds[c]] = True
    later = stage > peak
    next_read = np.full(graph.n, graph.n, dtype=np.int64)
    for c, s in zip(node[later].tolist(), stage[later].tolist()):
        for p in graph.preds[c].tolist():
            if s < next_read[p]:
                next_read[p] = s
    scored = []
    for i in np.nonzero(live & movable & ~read_there & (next_read < graph.n))[0].tolist():
        preds = graph.preds[i]
        freed = int(graph.size[i]) - int(graph.size[preds[~live[preds]]].sum())
        if freed > 0:
            scored.append((-freed / max(float(graph.cost[i]), 1e-12), i, freed))
    moves = []
    for _, i, freed in sorted(scored):
        moves.append((i, int(next_read[i])))
        excess -= freed
        if excess <= 0:
            break
    return moves
