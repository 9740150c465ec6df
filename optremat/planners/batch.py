"""The largest batch that fits a memory size, with and without planning.

A model is traced (on fake tensors) at two small batch sizes; every tensor's bytes and
every op's workspace are affine in the batch size, so the graph at any batch follows
without tracing or allocating at that size. Costs are interpolated the same way, which
is approximate (a roofline cost is the larger of a compute and a memory time), so the
overhead of a planned batch is an estimate. The search grows the batch geometrically
until it stops fitting, then bisects.

A step that can run in other ways computing the same thing (a causal LM's head and loss
in token chunks) gives each as an alternative: a planned batch fits when any way's plan
fits, its overhead counted against the first way's unplanned compute.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from optremat.core.budget import InfeasibleBudget
from optremat.core.coarsen import coarsen
from optremat.core.graph import Graph
from optremat.core.schedule import keep_all, simulate
from optremat.planners.solve import solve


@dataclass(frozen=True)
class BatchSearch:
    """Largest batch that fits unplanned, and planned within the overhead cap (with its
    overhead, and the name of the alternative way of running the step its plan takes;
    "" for the step as given)."""

    memory: int
    unplanned: int
    planned: int
    planned_overhead: float
    planned_with: str = ""

    @property
    def ratio(self) -> float:
        return self.planned / self.unplanned if self.unplanned else float("inf")


def graph_at(small: Graph, large: Graph, b_small: int, b_large: int) -> Callable[[int], Graph]:
    """The graph at any batch size, from the graphs traced at two batch sizes."""
    if small.names != large.names or small.ops != large.ops or not np.array_equal(small.edges, large.edges):
        raise ValueError("the step's graph changes shape with the batch size; max-batch needs a fixed structure")

    def at(batch: int) -> Graph:
        t = (batch - b_small) / (b_large - b_small)

        def affine(a: np.ndarray, b: np.ndarray, dtype: type) -> np.ndarray:
            value = np.maximum(a + (b - a) * t, 0)
            out = np.rint(value).astype(dtype) if dtype is np.int64 else value.astype(dtype)
            out.setflags(write=False)
            return out

        return replace(small, size=affine(small.size, large.size, np.int64),
                       workspace=affine(small.workspace, large.workspace, np.int64),
                       cost=affine(small.cost, large.cost, np.float64))

    return at


LIMIT = 1 << 20
"""The largest batch `max_batch` tries by default."""


def max_batch(graph_for: Callable[[int], Graph], memory: int, *, max_overhead: float = 0.25,
              time_limit: float = 10.0, deterministic: bool = False, limit: int = LIMIT,
              progress: Callable[[str, int, bool], None] | None = None,
              alternatives: Sequence[tuple[str, Callable[[int], Graph]]] = ()) -> BatchSearch:
    """Search the largest batch whose unplanned step fits `memory`, and the largest whose
    planned step fits with at most `max_overhead` extra compute (solver "auto" with
    `time_limit` per try, in deterministic time with `deterministic`, so that the answer
    does not depend on machine load; the planned step's peak is checked on every op).
    `alternatives` are other ways of running the step, by name: each is planned too, and
    the cheapest that fits is taken."""

    def unplanned(batch: int) -> tuple[bool, float, str]:
        graph = graph_for(batch)
        return simulate(graph, keep_all(graph)).peak_bytes <= memory, 0.0, ""

    def planned(batch: int) -> tuple[bool, float, str]:
        graph = graph_for(batch)
        if simulate(graph, keep_all(graph)).peak_bytes <= memory:
            return True, 0.0, ""
        fitting = []
        for name, way in [("", graph_for), *alternatives]:
            overhead = _planned_overhead(way(batch), memory, graph.total_cost, time_limit, deterministic)
            if overhead is not None and overhead <= max_overhead:
                fitting.append((overhead, name))
        return (True, *min(fitting)) if fitting else (False, 0.0, "")

    largest_unplanned, _, _ = _search(unplanned, 1, limit, "unplanned", progress)
    largest_planned, overhead, way = _search(planned, max(largest_unplanned, 1), limit, "planned", progress)
    return BatchSearch(memory, largest_unplanned, largest_planned, overhead, way)


def _planned_overhead(graph: Graph, memory: int, baseline: float, time_limit: float,
                      deterministic: bool) -> float | None:
    """The extra compute over `baseline` of `graph`'s plan within `memory` (None: none fits)."""
    coarse = coarsen(graph)
    try:
        solution = solve(coarse.coarse, memory, "auto", time_limit=time_limit, deterministic=deterministic)
    except (InfeasibleBudget, TimeoutError):
        return None
    result = simulate(coarse.fine, coarse.expand(solution.schedule))
    return None if result.peak_bytes > memory else (1 + result.overhead) * graph.total_cost / baseline - 1


def _search(fits: Callable[[int], tuple[bool, float, str]], start: int, limit: int, label: str,
            progress: Callable[[str, int, bool], None] | None) -> tuple[int, float, str]:
    """Largest batch in [1, limit] for which `fits` holds (0 if none), assuming it holds
    below some size and not above; with the overhead and way of that batch's plan."""
    def check(batch: int) -> tuple[bool, float, str]:
        found = fits(batch)
        if progress is not None:
            progress(label, batch, found[0])
        return found

    ok, *plan = check(start)
    if not ok:
        if start == 1:
            return 0, 0.0, ""
        return _search(fits, 1, start - 1, label, progress)
    good, good_plan, bad = start, plan, None
    while bad is None and good < limit:
        trial = min(good * 2, limit)
        ok, *plan = check(trial)
        if ok:
            good, good_plan = trial, plan
        else:
            bad = trial
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        ok, *plan = check(mid)
        if ok:
            good, good_plan = mid, plan
        else:
            bad = mid
    return good, *good_plan
