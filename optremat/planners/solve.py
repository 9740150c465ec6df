"""Graph-level planning: one entry point over every planner, and the `auto` strategy."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from optremat.core.budget import InfeasibleBudget, resolve_budget
from optremat.core.deadline import ends_before
from optremat.core.graph import Graph
from optremat.core.schedule import Schedule, keep_all, simulate
from optremat.core.solution import FEASIBLE, HEURISTIC, OPTIMAL, Progress, Solution
from optremat.heuristics import (NotAChain, chain_dp, chen_greedy, chen_sqrt, dtr, greedy_benefit, mirror,
                                 split_lifetimes)
from optremat.ilp.bounds import solver_floor
from optremat.ilp.cpsat import solve_cpsat
from optremat.ilp.milp import solve_lp_rounding, solve_milp

HEURISTICS: dict[str, Callable[[Graph, int], Schedule]] = {
    "chen": chen_sqrt,
    "greedy": chen_greedy,
    "benefit": greedy_benefit,
    "mirror": mirror,
    "dtr": dtr,
    "split": split_lifetimes,
    "dp": chain_dp,
}
CHEAPEST_FIRST = ("chen", "dtr", "dp", "split", "benefit", "mirror", "greedy")
"""The heuristics by the time they took on a 64-layer Llama's coarsened joint graph (6,112
nodes: 0.06 s to 1.7 s), least first, so that a deadline cuts the slowest: there
`split` planned at +6.50% in 0.73 s, and `greedy`, 1.73 s, found nothing."""
EXACT = ("cpsat", "ilp", "lp-rounding")
MAX_COPIES = 4
"""Most computations per node `auto` lets CP-SAT consider so that a heuristic hint fits its model."""


@dataclass(frozen=True)
class Options:
    """What a planner may be told beyond the graph and the budget (each uses what applies)."""

    time_limit: float = 30.0
    hint: Schedule | None = None
    copies: int = 2
    workers: int = 0
    seed: int = 0
    deterministic: bool = False
    progress: Progress | None = None
    share: bool = False


Planner = Callable[[Graph, int, Options], Solution]
"""The one planner contract: a graph and a budget in bytes (above what keeping everything
needs) to a Solution within it, or InfeasibleBudget."""


def heuristic(graph: Graph, budget: int, name: str) -> Solution:
    """Run one heuristic and wrap its schedule as a Solution."""
    started = time.perf_counter()
    schedule = HEURISTICS[name](graph, budget)
    return Solution(schedule=schedule, solver=name, status=HEURISTIC, cost=simulate(graph, schedule).cost,
                    lower_bound=None, seconds=time.perf_counter() - started)


def with_shares(graph: Graph, solution: Solution) -> Solution:
    """`solution` sharing wherever its schedule allows (`simulate(share=True)`, a superset
    of any shares a solver chose): the same cost, a peak no higher."""
    return replace(solution, shared=simulate(graph, solution.schedule, share=True).shared)


def best_heuristic(graph: Graph, budget: int, deadline: float | None = None) -> tuple[Solution | None, int | None]:
    """The cheapest plan any heuristic finds within budget (or None), and the smallest
    peak any heuristic reached when none fits (or None). They run cheapest first, and
    once one found a plan, none is begun that would end past `deadline` if it took as
    long as the last (on a 64-layer Llama's joint graph the seven took 5 to 8 s)."""
    found, smallest, took = [], None, 0.0
    for name in CHEAPEST_FIRST:
        if found and not ends_before(deadline, took):
            break
        begun = time.perf_counter()
        try:
            found.append(heuristic(graph, budget, name))
        except InfeasibleBudget as error:
            smallest = error.smallest if smallest is None else min(smallest, error.smallest)
        except NotAChain:
            continue
        finally:
            took = time.perf_counter() - begun
    return min(found, key=lambda s: s.cost, default=None), smallest


def solve(graph: Graph, budget: int | float | str, solver: str = "auto", time_limit: float = 30.0, *,
          hint: Schedule | None = None, copies: int = 2, workers: int = 0, seed: int = 0,
          deterministic: bool = False, progress: Progress | None = None, share: bool = False) -> Solution:
    """The least-cost plan for `graph` under `budget` that `solver` finds.

    With `share`, ops may write their output over an input they are the last to hold
    (`Graph.shareable`), priced in the budget: CP-SAT and the MILP decide which, the
    other planners share wherever their schedule allows (`Solution.shared`).

    `auto` runs the heuristics, hands the best to CP-SAT as a hint (raising `copies` to
    what the hint uses, up to MAX_COPIES) and returns the best plan found within
    `time_limit` (heuristics, bound and model building included; with `deterministic`,
    CP-SAT's deterministic time alone), never worse than the
    hint (a hint beyond the model's copies that still wins is returned with
    `solver_floor`'s bound alone, which holds for every plan). Every returned schedule
    has a simulated peak within budget; an impossible budget raises InfeasibleBudget
    naming the smallest feasible one.
    """
    if solver not in PLANNERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    options = Options(time_limit=time_limit, hint=hint, copies=copies, workers=workers, seed=seed,
                      deterministic=deterministic, progress=progress, share=share)
    found = _solve(graph, budget, solver, options)
    return with_shares(graph, found) if share else found


def _solve(graph: Graph, budget: int | float | str, solver: str, options: Options) -> Solution:
    budget_bytes = resolve_budget(graph, budget)
    if budget_bytes < graph.pinned_bytes:
        raise InfeasibleBudget(budget_bytes, graph.pinned_bytes, solver, proven=True)
    unplanned = keep_all(graph)
    if simulate(graph, unplanned, share=options.share).peak_bytes <= budget_bytes:
        return Solution(schedule=unplanned, solver=solver, status=OPTIMAL, cost=graph.total_cost,
                        lower_bound=graph.total_cost, seconds=0.0)
    return PLANNERS[solver](graph, budget_bytes, options)


def _milp(graph: Graph, budget: int, options: Options) -> Solution:
    return solve_milp(graph, budget, time_limit=options.time_limit, hint=options.hint, workers=options.workers,
                      share=options.share)


def _cpsat(graph: Graph, budget: int, options: Options) -> Solution:
    found = solve_cpsat(graph, budget, time_limit=options.time_limit, hint=options.hint, copies=options.copies,
                        workers=options.workers, seed=options.seed, deterministic=options.deterministic,
                        progress=options.progress, share=options.share)
    return replace(found, solver="cpsat")


def _auto(graph: Graph, budget_bytes: int, options: Options) -> Solution:
    """CP-SAT hinted with the best heuristic plan, never worse than that plan; the
    heuristics take at most about half the time limit (all of them when `deterministic`)."""
    started = time.perf_counter()
    seed_plan, heuristic_smallest = best_heuristic(
        graph, budget_bytes, None if options.deterministic else started + options.time_limit / 2)
    hint, copies = options.hint, options.copies
    if seed_plan is not None and hint is None:
        hint = seed_plan.schedule
        copies = max(copies, min(int(np.bincount(hint.node).max()), MAX_COPIES))
    elapsed = 0.0 if options.deterministic else time.perf_counter() - started
    remaining = max(options.time_limit - elapsed, 0.0)

    def fallback(bound: float | None = None) -> Solution:
        """The seed plan, with `bound` if it holds for it, else the bound every plan obeys."""
        if bound is None and not options.share:
            bound = graph.total_cost + solver_floor(graph, budget_bytes, options.time_limit, share=False)
        optimal = bound is not None and seed_plan.cost <= bound + 1e-9 * graph.total_cost
        return replace(seed_plan, seconds=time.perf_counter() - started, lower_bound=bound,
                       status=OPTIMAL if optimal else HEURISTIC if bound is None else FEASIBLE)

    try:
        exact = _cpsat(graph, budget_bytes, replace(options, time_limit=remaining, hint=hint, copies=copies))
    except InfeasibleBudget as error:
        if seed_plan is not None:
            return fallback()
        if heuristic_smallest is not None and heuristic_smallest < error.smallest:
            raise InfeasibleBudget(budget_bytes, heuristic_smallest, "auto") from None
        raise
    except TimeoutError:
        if seed_plan is None:
            raise
        return fallback()
    if seed_plan is not None and seed_plan.cost < exact.cost:
        return fallback(exact.lower_bound if np.bincount(seed_plan.schedule.node).max() <= copies else None)
    return replace(exact, solver="auto", seconds=time.perf_counter() - started)


PLANNERS: dict[str, Planner] = {
    "auto": _auto,
    "cpsat": _cpsat,
    "ilp": _milp,
    "lp-rounding": lambda graph, budget, options: solve_lp_rounding(graph, budget),
    **{name: (lambda graph, budget, options, name=name: heuristic(graph, budget, name)) for name in HEURISTICS},
}
"""Every planner `solve` offers, by name: the exact ones, `auto`, and the heuristics."""
SOLVERS = tuple(PLANNERS)
