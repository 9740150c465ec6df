"""Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021), run as a simulation.

The graph is executed in order under the budget; before an allocation that would not
fit, DTR evicts the resident tensor with the least h_DTR = recompute cost /
(bytes × staleness), over a random sample of √N candidates and ignoring tiny tensors
(MegEngine's filter); an evicted tensor a later op needs is recomputed on demand,
recursively; only the inputs of the op being computed are pinned. A tensor evicted and
needed again within one stage is computed there once and held in between. The recomputations it performed become a Schedule, so dynamic and static
plans are compared by the same simulator.
"""

from __future__ import annotations

import math
import random

import numpy as np

from optremat.core.budget import InfeasibleBudget
from optremat.core.graph import Graph
from optremat.core.schedule import Schedule, from_computations, simulate


class _Pool:
    """Evictable resident tensors with O(1) insert, remove and random sampling."""

    def __init__(self) -> None:
        self.items: list[int] = []
        self.where: dict[int, int] = {}

    def add(self, i: int) -> None:
        if i not in self.where:
            self.where[i] = len(self.items)
            self.items.append(i)

    def discard(self, i: int) -> None:
        k = self.where.pop(i, None)
        if k is not None:
            last = self.items.pop()
            if k < len(self.items):
                self.items[k] = last
                self.where[last] = k


def dtr(graph: Graph, budget: int, *, seed: int = 0, sample: bool = True, small: float = 0.01) -> Schedule:
    """DTR's schedule under `budget`; InfeasibleBudget when eviction cannot make room."""
    n = graph.n
    size = np.array([sum(int(graph.unit_size[u]) for u in graph.units[i]) for i in range(n)])
    forever = graph.pinned | graph.output
    last_read = np.array([max(graph.succs[i].tolist(), default=i) for i in range(n)])
    evictable = ~forever & (size >= small * size[size > 0].mean() if (size > 0).any() else size > 0)
    rng = random.Random(seed)
    resident = graph.pinned.copy()
    accessed = np.zeros(n)
    pool = _Pool()
    state = {"memory": int(size[graph.pinned].sum()), "clock": 0.0}
    computations: list[tuple[int, int]] = []

    def score(i: int) -> float:
        neighbourhood = graph.cost[i] + sum(graph.cost[p] for p in graph.preds[i].tolist() if not resident[p])
        staleness = state["clock"] - accessed[i] + 1.0
        return neighbourhood / (size[i] * staleness)

    def make_room(need: int) -> None:
        while state["memory"] + need > budget and pool.items:
            k = max(1, math.isqrt(len(pool.items))) if sample else len(pool.items)
            candidates = rng.sample(pool.items, k) if k < len(pool.items) else list(pool.items)
            victim = min(candidates, key=score)
            pool.discard(victim)
            resident[victim] = False
            state["memory"] -= int(size[victim])

    def compute(v: int, stage: int, touched: list[int]) -> None:
        preds = graph.preds[v].tolist()
        for p in preds:
            pool.discard(p)
        for p in preds:
            if not resident[p]:
                compute(p, stage, touched)
                pool.discard(p)
        make_room(int(size[v] + graph.workspace[v]))
        resident[v] = True
        state["memory"] += int(size[v])
        state["clock"] += 1.0
        accessed[v] = state["clock"]
        accessed[preds] = state["clock"]
        touched.extend(preds + [v])
        for i in preds + [v]:
            if evictable[i]:
                pool.add(i)
        if v != stage:
            computations.append((v, stage))

    for t in range(n):
        if graph.pinned[t]:
            continue
        touched: list[int] = []
        compute(t, t, touched)
        for i in set(touched):
            if resident[i] and not forever[i] and last_read[i] <= t:
                resident[i] = False
                state["memory"] -= int(size[i])
                pool.discard(i)
    schedule = from_computations(graph, computations)
    peak = simulate(graph, schedule).peak_bytes
    if peak > budget:
        raise InfeasibleBudget(budget, peak, "dtr")
    return schedule
