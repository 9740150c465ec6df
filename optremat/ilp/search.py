"""Running CP-SAT on an interval model: time limits that cover model building, presolve
sized to the model, and restarts of a stalled search from its best plan."""

from __future__ import annotations

import math
import numbers
import os
import threading
import time
from typing import Callable

import numpy as np
from ortools.sat.python import cp_model

from optremat.ilp.interval import IntervalModel

LEAST_SECONDS = 0.5
"""Time a solver gets even when building its model used up the limit, so that a hinted
solve can still return its hint."""
RESERVE = 0.02
"""Share of the limit kept for stopping and reading the plan back: on 5,001 nodes CP-SAT
stops 0.4 s after its limit and the schedule takes another 0.1 s to read and price."""


def seconds_left(time_limit: float, started: float) -> float:
    """What is left of `time_limit` since `started`: solver limits cover model building."""
    return max(time_limit * (1 - RESERVE) - (time.perf_counter() - started), LEAST_SECONDS)


PRESOLVE_LIMIT = 1000
"""Graphs with more nodes skip CP-SAT's presolve when a hint is given: on 5,000 nodes
presolve alone outlasts a minute, while the hinted plan is accepted in 2 s without it."""
LIGHT_PRESOLVE_VARIABLES = 20_000
"""Hinted models with more variables get a light presolve (one pass, no probing): on the
500-node random layered graph (27,000 variables) full presolve delays the hinted plan by
9 s, the light one by under 1 s."""


def presolve_for(model: IntervalModel, hinted: bool) -> str:
    if not hinted:
        return "full"
    if model.graph.n > PRESOLVE_LIMIT:
        return "none"
    return "light" if len(model.model.proto.variables) > LIGHT_PRESOLVE_VARIABLES else "full"


MAX_WORKERS = 10_000
"""The most CP-SAT workers a search is given: 100,000 made CP-SAT reject the model."""


def check_search(workers: object, seed: object, prefix: str = "") -> None:
    """Refuse worker counts and seeds CP-SAT cannot take (its seed is a 32-bit integer),
    naming them with `prefix` (the command line's "--")."""
    for name, value, low, high in (("workers", workers, 0, MAX_WORKERS), ("seed", seed, -2**31, 2**31 - 1)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
            raise ValueError(f"{prefix}{name} must be a whole number from {low:,} to {high:,}"
                             f"{' (0: all cores)' if name == 'workers' else ''}, not {value!r}")


def check_time_limit(time_limit: object, prefix: str = "") -> None:
    """Refuse a time limit that is not a finite number of seconds above 0 (CP-SAT failed
    on a NaN with an empty message), naming it with `prefix`."""
    if (isinstance(time_limit, bool) or not isinstance(time_limit, numbers.Real)
            or not math.isfinite(time_limit) or time_limit <= 0):
        raise ValueError(f"{prefix}time_limit must be a finite number of seconds > 0, not {time_limit!r}")


def configure(solver: cp_model.CpSolver, time_limit: float, started: float, workers: int, seed: int,
              deterministic: bool, presolve: str = "full") -> None:
    """Deterministic runs get `time_limit` of deterministic time, so that they repeat;
    others get what is left of it since `started`."""
    params = solver.parameters
    params.cp_model_presolve = presolve != "none"
    if presolve == "light":
        params.max_presolve_iterations = 1
        params.cp_model_probing_level = 0
    params.num_workers = workers or os.cpu_count() or 1
    params.random_seed = seed
    if deterministic:
        params.interleave_search = True
        params.max_deterministic_time = time_limit
    else:
        params.max_time_in_seconds = seconds_left(time_limit, started)


HINT_CHECK_TIME = 1.0
"""Deterministic seconds the check of a hint may take (`hint_extends`): with the hinted
values fixed, checks on the 5,001-node random training graph at 50% take under 0.01
(0.4-1.1 s of wall time)."""


def hint_extends(model: cp_model.CpModel) -> bool:
    """Whether the model's hint extends to a solution: one worker (so no interleaved
    search, and the same answer on every run) solves the model with the hinted variables
    fixed to their hinted values, within HINT_CHECK_TIME; an unfinished check counts as no."""
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.num_workers = 1
    params.cp_model_presolve = False
    params.fix_variables_to_their_hinted_value = True
    params.stop_after_first_solution = True
    params.max_deterministic_time = HINT_CHECK_TIME
    return solver.solve(model) in (cp_model.OPTIMAL, cp_model.FEASIBLE)


def safe_hint(model: IntervalModel, presolve: str) -> str:
    """Drops the model's hint unless it extends to a solution, and returns the presolve
    for the model as it is left. Deterministic searches call this before solving: under
    interleaved search (`configure`) CP-SAT 9.15 aborts the whole process (`Check failed:
    heuristics.fixed_search != nullptr`) when a subsolver proves a hinted model infeasible
    while loading it, as it does for a 1,002-node chain hinted with its unplanned schedule
    at a budget no plan fits (no presolve on hinted models of over PRESOLVE_LIMIT nodes).
    A hint that extends to a solution proves the model feasible, so the hints that speed
    searches up are kept; the others (a schedule over the budget, or beyond the model's
    copies) go, and the unhinted search proves an infeasible model so without aborting."""
    if not len(model.model.proto.solution_hint.vars) or hint_extends(model.model):
        return presolve
    model.model.clear_hints()
    return presolve_for(model, hinted=False)


STALL_SHARE = 0.15
"""A search that finds no better plan for this share of its limit (LEAST_STALL seconds at
least) starts again from its best plan with the next seed: on resnet at 50%, one-minute
searches stall for 15 s or more at 6.96–8.53% overhead, and reach 6.18% (0.73% from the
bound) in 12 of 15 runs with restarts against 2 of 5 without."""
LEAST_STALL = 5.0
LEAST_RESTART = 1.0
"""Seconds left that still restart a stalled search: at a 10 s limit a search stalled for
LEAST_STALL seconds stops at about 7 s; resnet-mini's step under Inductor, restarted
there, ends at 1.0136-1.0271 of its unplanned cost (median 1.0137 in 9 runs) against
1.0137-1.0385 (median 1.0271) when it returns then."""
RESTART_GAP = 0.01
"""Searches within this gap of their bound run on uninterrupted, since a restart also
discards the proof under way: with restarts at any gap, mobilenet at 0.8 ran its whole
minute at the optimum it had reached in 6 s instead of proving it in 8.6 s."""
RESTART_NODES = 1000
"""Larger graphs keep one search: on the 1,001-node random training graph at 50%,
one-minute searches restarted after 9 s stalls ended at 8.77% and 9.07% overhead against
8.49–8.66% for single searches, whose LNS there improves slowly but steadily."""


class _Watch(cp_model.CpSolverSolutionCallback):
    """Passes each better plan to `report` and stops the search once `stall` seconds pass
    without one while the gap (relative to `offset` plus the objective) exceeds
    RESTART_GAP; never when `stall` is None."""

    def __init__(self, solver: cp_model.CpSolver, stall: float | None, offset: float, bound: float,
                 report: Callable[[float, float], None] | None) -> None:
        super().__init__()
        self.solver, self.stall, self.offset, self.report = solver, stall, offset, report
        self.objective, self.bound = np.inf, bound
        self.stalled = False
        self.timer: threading.Timer | None = None
        solver.best_bound_callback = self._bound

    def on_solution_callback(self) -> None:
        self.objective = self.objective_value
        self._bound(self.best_objective_bound)
        if self.report:
            self.report(self.objective_value, self.bound)
        if self.stall is not None:
            self.cancel()
            self.timer = threading.Timer(self.stall, self._stop)
            self.timer.daemon = True
            self.timer.start()

    def _bound(self, bound: float) -> None:
        self.bound = max(self.bound, bound)

    def _stop(self) -> None:
        if self.objective - self.bound > RESTART_GAP * (self.offset + self.objective):
            self.stalled = True
            self.solver.stop_search()

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


def search(model: IntervalModel, time_limit: float, started: float, offset: float, *, workers: int,
            seed: int, deterministic: bool, presolve: str, tolerance: float = 0.0,
            report: Callable[[float, float, float], None] | None = None) -> tuple[int, cp_model.CpSolver, float]:
    """Solves `model` within `time_limit` since `started`, restarting a stalled search
    from its best plan with the next seed (not in deterministic mode, whose runs repeat,
    nor on graphs of over RESTART_NODES nodes); `offset` is what the gap is relative to,
    besides the objective, in objective units. A plan within `tolerance` (objective
    units) of the bound counts as optimal, so that CP-SAT does not spend the rest of its
    limit on differences the objective cannot resolve. A deterministic search keeps the
    model's hint only where it extends to a solution (`safe_hint`).

    Returns the status, the solver holding the best plan and the best objective bound
    any round proved; `report` gets (elapsed seconds, objective, bound) per better plan.
    """
    if deterministic:
        presolve = safe_hint(model, presolve)
    restarts = not deterministic and model.graph.n <= RESTART_NODES
    stall = max(STALL_SHARE * time_limit, LEAST_STALL) if restarts else None
    best: cp_model.CpSolver | None = None
    bound = -np.inf

    def better(objective: float, round_bound: float) -> None:
        if best is None or objective < best.objective_value:
            report(time.perf_counter() - started, objective, round_bound)

    restart = 0
    while True:
        solver = cp_model.CpSolver()
        configure(solver, time_limit, started, workers, seed + restart, deterministic, presolve)
        solver.parameters.absolute_gap_limit = max(solver.parameters.absolute_gap_limit, tolerance)
        watch = _Watch(solver, stall, offset, bound, better if report else None)
        status = solver.solve(model.model, watch)
        watch.cancel()
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return (status, solver, bound) if best is None else (cp_model.FEASIBLE, best, bound)
        bound = max(watch.bound, solver.best_objective_bound)
        if best is None or solver.objective_value <= best.objective_value:
            best = solver
        if status == cp_model.OPTIMAL:
            return status, solver, bound
        if not watch.stalled or time_limit * (1 - RESERVE) - (time.perf_counter() - started) < LEAST_RESTART:
            return status, best, bound
        model.model.clear_hints()
        model.model.proto.solution_hint.vars.extend(range(len(best.response_proto.solution)))
        model.model.proto.solution_hint.values.extend(list(best.response_proto.solution))
        presolve = presolve_for(model, hinted=True)
        restart += 1
