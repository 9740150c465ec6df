"""CP-SAT planners over the interval model (`optremat.ilp.interval`): the least-cost
schedule under a budget, the least-peak schedule under an overhead, and the error that
names the smallest budget when none fits."""

from __future__ import annotations

import time

import numpy as np
from ortools.sat.python import cp_model

from optremat.core.budget import InfeasibleBudget
from optremat.core.graph import Graph
from optremat.core.schedule import Schedule, keep_all, recompute_all, simulate
from optremat.core.solution import FEASIBLE, OPTIMAL, Progress, Solution
from optremat.ilp.bounds import solver_floor, tighten
from optremat.ilp.interval import IntervalModel
from optremat.ilp.search import presolve_for, search


def solve_cpsat(graph: Graph, budget: int, *, time_limit: float = 30.0, hint: Schedule | None = None,
                copies: int = 2, workers: int = 0, seed: int = 0, deterministic: bool = False,
                progress: Progress | None = None, share: bool = False) -> Solution:
    """The least-cost schedule whose simulated peak is at most `budget` bytes; with
    `share`, ops may also write over inputs they are the last to hold (`Solution.shared`).

    A plan within the integer objective's rounding of the proven bound is optimal: on
    gpt-mini's step graph CP-SAT reached its bound to 1.3e-6 of the step's cost in 5 s,
    then spent the other 25 s of its limit on that rounding. The bound returned is the
    proven one less that rounding, so that it holds for the plans' real costs.

    Raises InfeasibleBudget when the model proves no schedule fits (with the smallest
    feasible budget, found by `min_peak_cpsat`), or TimeoutError when the time limit
    passes with no plan found and no proof either way.
    """
    started = time.perf_counter()
    if budget < graph.pinned_bytes:
        raise InfeasibleBudget(budget, graph.pinned_bytes, "cpsat", proven=True)
    extra = solver_floor(graph, budget, time_limit, share)
    model = IntervalModel(graph, copies, budget, share)
    model.model.minimize(model.extra_cost)
    if np.isfinite(extra):
        model.model.add(model.extra_cost >= model.integer_floor(extra))
    if hint is not None:
        model.hint(hint)
    def report(elapsed: float, objective: float, bound: float) -> None:
        progress(elapsed, graph.total_cost + objective / model.scale, graph.total_cost + bound / model.scale)

    status, solver, proven = search(model, time_limit, started, graph.total_cost * model.scale, workers=workers,
                                     seed=seed, deterministic=deterministic, tolerance=model.rounding,
                                     presolve=presolve_for(model, hint is not None), report=report if progress else None)
    if status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"cpsat rejected the model: {model.model.validate()}")
    if status == cp_model.INFEASIBLE:
        raise infeasible(graph, budget, "cpsat", time_limit, copies=copies, share=share, workers=workers, seed=seed,
                         deterministic=deterministic)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise TimeoutError(f"cpsat found no plan within {time_limit:g} s and proved none impossible "
                           f"({solver.status_name(status)}); allow more time or a larger budget")
    schedule = model.schedule(solver)
    shared = model.shared(solver, schedule)
    cost = simulate(graph, schedule, share=frozenset(shared)).cost
    bound, optimal = graph.total_cost + (proven - model.rounding) / model.scale, status == cp_model.OPTIMAL
    if not share:
        bound, optimal = tighten(graph, cost, bound, optimal, extra)
    return Solution(schedule=schedule, solver="cpsat", status=OPTIMAL if optimal else FEASIBLE, cost=cost,
                    lower_bound=bound, seconds=time.perf_counter() - started, copies=copies, shared=shared)


def min_peak_cpsat(graph: Graph, *, max_overhead: float | None = None, time_limit: float = 30.0,
                   copies: int = 2, workers: int = 0, seed: int = 0, deterministic: bool = False,
                   hint: Schedule | None = None, share: bool = False) -> Solution:
    """The schedule with the least peak memory whose overhead is at most `max_overhead`
    (unbounded when None). `lower_bound` is then a proven bound on the peak in bytes."""
    started = time.perf_counter()
    model = IntervalModel(graph, copies, None, share)
    if max_overhead is not None:
        model.model.add(model.extra_cost <= int(max_overhead * graph.total_cost * model.scale))
    model.model.minimize(model.capacity)
    if hint is not None:
        model.hint(hint)
    status, solver, proven = search(model, time_limit, started, graph.pinned_bytes, workers=workers, seed=seed,
                                     deterministic=deterministic, presolve=presolve_for(model, hint is not None))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise TimeoutError(f"cpsat found no plan within {time_limit:g} s ({solver.status_name(status)})")
    schedule = model.schedule(solver)
    shared = model.shared(solver, schedule)
    return Solution(schedule=schedule, solver="cpsat-min-peak",
                    status=OPTIMAL if status == cp_model.OPTIMAL else FEASIBLE,
                    cost=simulate(graph, schedule, share=frozenset(shared)).cost, shared=shared,
                    lower_bound=graph.pinned_bytes + proven,
                    seconds=time.perf_counter() - started, copies=copies)


def infeasible(graph: Graph, budget: int, planner: str, time_limit: float, copies: int = 2,
               share: bool = False, *, workers: int = 0, seed: int = 0,
               deterministic: bool = False) -> InfeasibleBudget:
    """The error for a budget below what any plan reaches, naming the smallest feasible
    budget the peak-minimising model finds (proven when it solves to optimality). When
    that search finds no plan in `time_limit`, the error names the least peak of keeping
    everything and recomputing everything, unproven: a budget no plan fits is always
    reported as such, never as a timeout."""
    scope = f" (plans computing each node at most {copies} times)"
    try:
        smallest = min_peak_cpsat(graph, time_limit=time_limit, copies=copies, share=share, workers=workers,
                                  seed=seed, deterministic=deterministic)
    except TimeoutError:
        peak = min(simulate(graph, schedule).peak_bytes for schedule in (keep_all(graph), recompute_all(graph)))
        return InfeasibleBudget(budget, peak, planner, proven=False, scope=scope)
    peak = simulate(graph, smallest.schedule, share=frozenset(smallest.shared)).peak_bytes
    return InfeasibleBudget(budget, peak, planner, proven=smallest.status == OPTIMAL, scope=scope)
