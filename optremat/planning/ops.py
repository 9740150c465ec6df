"""Plans that run on every op as scheduled, as compiled graphs run them.

`plan_step` solves a step graph on its coarsened form and expands the schedule back to
every op, solving again with another budget when the expanded plan peaks over it or
leaves room unused; `least_plan` is the least-peak plan the heuristics find; `kept_plan`
is the plan of a keep set another planner chose.
"""

from __future__ import annotations

import time

import numpy as np

from optremat.core.budget import InfeasibleBudget
from optremat.core.coarsen import Coarsened, coarsen
from optremat.core.graph import Graph
from optremat.core.schedule import (Schedule, SimResult, from_computations, from_kept, keep_all, simulate,
                                    without_recomputing)
from optremat.core.solution import HEURISTIC, Progress, Solution
from optremat.planners.solve import best_heuristic, solve
from optremat.planning.result import Plan

ATTEMPTS = 4
"""Solves tried per plan, each with the budget moved by the last plan's excess or slack."""
SLACK = 0.005
"""A plan that leaves more than this share of its budget unused is solved again with more."""


def plan_step(graph: Graph, budget_bytes: int, *, solver: str = "auto", time_limit: float = 30.0, workers: int = 0,
              seed: int = 0, deterministic: bool = False, progress: Progress | None = None,
              started: float | None = None, share: bool = True, once: np.ndarray | None = None) -> Plan:
    """A plan that runs on every op of `graph` as scheduled (each op computed where the
    schedule puts it, any number of times), solved on the coarsened graph and expanded
    to every op, each tensor kept only until the last read it serves.

    The coarse model's peak differs from the expanded plan's, so the budget the solver
    is given moves by the difference, down when the plan peaks over the budget and up
    when it leaves more than SLACK of it unused (starting from the plan that fit), then
    halfway between the largest that fit and the smallest that did not; the cheapest
    plan that fits wins. Once the
    solver finds no plan (or none in time), the best heuristic plan within the budget,
    or else at the smallest budget the solver names (or the heuristics reach), is the
    last try. `share` prices ops writing over inputs they are the last to read, as
    compiled graphs run them. `once` marks nodes of `graph` that run exactly once (random
    ops, writes in place, the gradients handed to the backward): a plan's reruns of them
    are dropped and their one result kept instead, as the compiled graphs run them, before
    the plan is priced, so the budget the solver is given moves by what that costs too.
    Past the time limit a plan that fits is not solved again."""
    started = time.perf_counter() if started is None else started
    coarse = coarsen(graph)
    once_fine = None if once is None else once[coarse.original]
    target, deadline, smallest, best = budget_bytes, started + time_limit, None, None
    fits_at, fails_at = None, None
    for _ in range(ATTEMPTS):
        if best is not None and not deterministic and time.perf_counter() >= deadline:
            break
        remaining = time_limit if deterministic else max(deadline - time.perf_counter(), 1.0)
        exhausted = False
        try:
            solution = solve(coarse.coarse, target, solver, time_limit=remaining, workers=workers, seed=seed,
                             deterministic=deterministic, progress=progress,
                             hint=None if best is None or target < budget_bytes else best[0].schedule)
        except (InfeasibleBudget, TimeoutError) as error:
            solution, least = ((None, error.smallest) if isinstance(error, InfeasibleBudget)
                               else best_heuristic(coarse.coarse, target))
            if solution is None and least is not None:
                solution = best_heuristic(coarse.coarse, least)[0]
            if solution is None:
                if least is None or best is not None:
                    break
                raise InfeasibleBudget(budget_bytes, least, f"{solver} (on the coarsened graph)") from None
            exhausted = True
        fine = _expanded(coarse, solution)
        if once_fine is not None:
            fine = without_recomputing(coarse.fine, fine, once_fine)
        result = simulate(coarse.fine, fine, share=share)
        smallest = result.peak_bytes if smallest is None else min(smallest, result.peak_bytes)
        if result.peak_bytes <= budget_bytes and (best is None or result.cost < best[2].cost):
            best = solution, fine, result
        if exhausted or (1 - SLACK) * budget_bytes <= result.peak_bytes <= budget_bytes:
            break
        if result.peak_bytes <= budget_bytes:
            fits_at = target
        else:
            fails_at = target
        target = (target + budget_bytes - result.peak_bytes if fits_at is None or fails_at is None
                  else (fits_at + fails_at) // 2)
    if best is None:
        raise InfeasibleBudget(budget_bytes, smallest, f"{solver} on every op")
    return _step_plan(graph, coarse.fine, *best, budget_bytes, started)


def least_plan(graph: Graph, *, share: bool = True) -> Plan:
    """The least-peak plan the heuristics find on the coarsened graph, expanded to every
    op: it exists whatever the budget and is found the same way every time, so the peak
    it reaches is a smallest budget that planning again at it always meets."""
    started = time.perf_counter()
    coarse = coarsen(graph)
    budget = best_heuristic(coarse.coarse, 0)[1] or 0
    for _ in range(ATTEMPTS):
        solution, reached = best_heuristic(coarse.coarse, budget)
        if solution is not None:
            break
        # a heuristic that once reached `budget` may not meet it when asked to
        budget = max(reached or 0, int(budget * 1.01) + 1)
    else:
        solution = Solution(schedule=keep_all(coarse.coarse), solver="unplanned", status=HEURISTIC,
                            cost=coarse.coarse.total_cost, lower_bound=None, seconds=0.0)
    fine = _expanded(coarse, solution)
    result = simulate(coarse.fine, fine, share=share)
    return _step_plan(graph, coarse.fine, solution, fine, result, result.peak_bytes, started)


def kept_plan(graph: Graph, kept: np.ndarray, source: str, *, share: bool = True) -> Plan:
    """The plan that keeps the forward tensors in `kept` for the backward and recomputes
    every other one the backward reads where it first needs it (`from_kept` with reuse),
    named for the planner that chose `kept`."""
    started = time.perf_counter()
    schedule = from_kept(graph, kept, reuse=True)
    result = simulate(graph, schedule, share=share)
    solution = Solution(schedule=schedule, solver=source, status=HEURISTIC, cost=result.cost, lower_bound=None,
                        seconds=0.0)
    return _step_plan(graph, graph, solution, schedule, result, result.peak_bytes, started)


def _expanded(coarse: Coarsened, solution: Solution) -> Schedule:
    """A coarse plan on every op, each tensor kept only until the last read it serves."""
    expanded = coarse.expand(solution.schedule)
    return from_computations(coarse.fine, [(i, s) for i, s, _ in expanded.events if s != i])


def _step_plan(graph: Graph, fine_graph: Graph, solution: Solution, schedule: Schedule, result: SimResult,
               budget_bytes: int, started: float) -> Plan:
    total = graph.total_cost
    return Plan(graph=fine_graph, schedule=schedule, regions=(), model_fingerprint="", budget_bytes=budget_bytes,
                predicted_peak_bytes=result.peak_bytes, baseline_peak_bytes=simulate(graph, keep_all(graph)).peak_bytes,
                predicted_overhead=result.overhead, solver=solution.solver, status=solution.status,
                lower_bound=None if solution.lower_bound is None else solution.lower_bound / total - 1,
                solve_seconds=time.perf_counter() - started, solver_overhead=result.overhead,
                runtime="compiled", shared=tuple(sorted(result.shared.items())))
