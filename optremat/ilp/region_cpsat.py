"""CP-SAT over module-region plans (`region_model`): the least-cost plan over candidate
calls under a budget, with the bound that proves it, and the plan with the least peak.

Every event's bytes are a row of the model, but only a few ever bind, so rows are added
as they are needed: solve with the rows so far, price the plan on the simulator, add the
rows of the events that overflow, and solve again from that plan. The rows are exact, so
a plan that fits on the simulator fits the model, and the solver's bound on the rows so
far bounds every plan over the candidates.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from ortools.sat.python import cp_model

from optremat.core.schedule import InvalidSchedule
from optremat.ilp.region_model import Atom, Literal, RegionModel, Row
from optremat.ilp.search import configure
from optremat.planners.regions import Call, Priced, Region, RegionMap, price

SCALE = 1e10
"""Integer units of cost in the unplanned step's cost: each op's cost is rounded down to
one in 1e10 of the step, so a bound is off by at most the number of ops in 1e10."""
PORTFOLIO = 8
"""CP-SAT workers unless told otherwise, whatever the cores: on the Llama at 70% and 80%
(2 cores, searching one depth of its module tree at a time) eight workers proved each in
under 0.5 s, one in under 3.4 s, and two (one per core) none within 20 s."""
ROWS_PER_ROUND = 16
"""Overflowing events whose rows join the model per round, the largest first."""


@dataclass(frozen=True, eq=False)
class RegionSolution:
    """The cheapest plan found that fits (None if none), the least cost any plan over the
    candidates can have (infinite when none fits, None when the time ran out before
    anything was proven), and whether the plan was proven the cheapest."""

    priced: Priced | None
    bound: float | None
    optimal: bool


def solve_regions(rmap: RegionMap, candidates: Sequence[Call], budget: int, time_limit: float, *,
                  hint: tuple[Region, ...] = (), workers: int = 0, seed: int = 0,
                  deterministic: bool = False) -> RegionSolution:
    """The least-cost plan over `candidates` whose simulated peak is at most `budget` bytes,
    searched for `time_limit` seconds (of deterministic time with `deterministic`) from
    the plan checkpointing `hint` when that plan fits (`workers` 0: `PORTFOLIO`). The LP
    relaxation of the rows' clauses is what proves bounds here: on one depth of the
    Llama's module tree at 80%, linearization level 2 proved the plan in 0.7 s, the
    default level not in 20 s. Building the model counts against `time_limit`, but for
    `deterministic`, which counts CP-SAT's deterministic time alone."""
    started = time.perf_counter()
    model = RegionModel(rmap, candidates)
    cp = _Cp(model, budget)
    status, solver, priced = _solve_lazily(cp, _fitting(model, hint, budget), time_limit, workers, seed,
                                           deterministic, started)
    if status == cp_model.INFEASIBLE:
        return RegionSolution(None, math.inf, False)
    if priced is None:
        return RegionSolution(None, None, False)
    fits = priced.result.peak_bytes <= budget
    return RegionSolution(priced if fits else None, cp.cost_of(solver.best_objective_bound),
                          fits and status == cp_model.OPTIMAL)


def _fitting(model: RegionModel, regions: tuple[Region, ...], budget: int) -> dict[Atom, bool] | None:
    """The decisions of the plan checkpointing `regions` if it fits `budget`, else None. A
    search under a budget takes hints only when a plan is known to fit: CP-SAT (9.15, with
    interleaved search) aborts the process when it proves a hinted model infeasible."""
    values = model.values_of(regions)
    if not model.realisable(values):
        return None
    priced = price(model.rmap, model.chosen(values), model.kept(values), "hint")
    return values if priced.result.peak_bytes <= budget else None


def least_peak(rmap: RegionMap, candidates: Sequence[Call], time_limit: float, *, workers: int = 0,
               seed: int = 0, deterministic: bool = False) -> tuple[Priced, bool]:
    """The plan over `candidates` with the least simulated peak found in `time_limit`,
    and whether it is proven the least."""
    started = time.perf_counter()
    model = RegionModel(rmap, candidates)
    cp = _Cp(model, None)
    status, solver, priced = _solve_lazily(cp, model.values([], []), time_limit, workers, seed, deterministic,
                                           started)
    if priced is None:
        return price(rmap, (), model.kept(model.values([], [])), "cpsat-regions"), False
    return priced, status == cp_model.OPTIMAL and priced.result.peak_bytes <= solver.value(cp.peak)


def _solve_lazily(cp: "_Cp", values: dict[Atom, bool] | None, time_limit: float, workers: int, seed: int,
                  deterministic: bool, started: float) -> tuple[int, cp_model.CpSolver | None, Priced | None]:
    """Solve from the plan `values` describes, price the plan, add the rows of the events
    over the model's limit, and solve again from that plan, until a plan has no such event
    or the time runs out: the last status, its solver, and its plan (None if the solver
    returned none). With `values` None no round takes a hint (see `_fitting`); the time
    counts from `started`, or with `deterministic` is the solver's deterministic time
    summed over the rounds, so that the rounds run, and the plan is, the same under any
    load."""
    model, rmap = cp.regions, cp.regions.rmap
    hinted = values is not None
    spent = 0.0

    def out_of_time() -> bool:
        return spent >= time_limit if deterministic else time.perf_counter() - started >= time_limit

    while True:
        cp.hint(values if hinted else None)
        solver = cp_model.CpSolver()
        left = time_limit - spent if deterministic else time_limit
        configure(solver, left, started, workers or PORTFOLIO, seed, deterministic)
        solver.parameters.linearization_level = 2
        status = solver.solve(cp.cp)
        spent += solver.deterministic_time
        if status == cp_model.MODEL_INVALID:
            raise RuntimeError(f"cpsat rejected the region model: {cp.cp.validate()}")
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return status, solver, None
        values = {atom: bool(solver.value(var)) for atom, var in cp.var.items()}
        try:
            priced = price(rmap, model.chosen(values), model.kept(values), "cpsat-regions")
        except InvalidSchedule:  # a region set whose lowering the simulator refuses: never returned
            cp.forbid(values)
            values = None
            if out_of_time():
                return status, solver, None
            continue
        curve, limit = priced.result.curve, cp.limit(solver)
        order = np.argsort(-curve, kind="stable")
        over = order[curve[order] > limit]
        if not len(over) or out_of_time():
            return status, solver, priced
        schedule = priced.lowering.schedule
        events = [(int(schedule.stage[e]), int(schedule.node[e])) for e in over[:ROWS_PER_ROUND].tolist()]
        if not cp.add_rows(model.row(s, v, model.call_of(s, v, values)) for s, v in events):
            raise RuntimeError(f"the region model misses an event over its limit on {model.structure}")


class _Cp:
    """The CP-SAT model: the decisions, their links, the rows added so far, and either the
    cost under `budget` or, with no budget, the peak (`peak`) to minimise."""

    def __init__(self, model: RegionModel, budget: int | None) -> None:
        self.regions, self.budget = model, budget
        self.cp = cp_model.CpModel()
        self.peak = None if budget is not None else self.cp.new_int_var(0, _most_bytes(model), "peak")
        self.var: dict[Atom, cp_model.IntVar] = {}
        self.rows: set[tuple[int, int, int]] = set()
        graph = model.graph
        self.scale = SCALE / max(graph.total_cost, 1e-12)
        objective = []
        for c in model.calls:
            x = self._bool(model.x(c.index))
            policy = self.cp.new_bool_var(f"policy{c.index}")
            objective.append(math.floor(c.rerun.cost * self.scale) * x)
            objective.append(math.floor(c.rerun.policy_looks * model.rmap.dispatch_seconds * self.scale) * policy)
            for o in model.saveable[c.index]:
                s = self._bool(model.s(o, c.index))
                self.cp.add_implication(s, x)
                self.cp.add_implication(s, policy)
                if o in c.forced:
                    self.cp.add(s == x)
            cost: dict[int, float] = {}
            for v in c.rerun.recomputable:
                o = int(model.owner[v])
                cost[o] = cost.get(o, 0.0) + float(graph.cost[v])
            for o, seconds in cost.items():
                r = self._bool(model.r(o, c.index))
                saved = self.var.get(model.s(o, c.index)[0])
                self.cp.add(r == x if saved is None else r + saved == x)
                objective.append(math.floor(seconds * self.scale) * r)
            self.cp.add(sum(self.var[model.r(o, c.index)[0]] for o in model.read_back(c)) >= x)
        for group in model.shared:
            self.cp.add_at_most_one(self.var[model.x(i)[0]] for i in group)
        self.cp.minimize(sum(objective) if self.peak is None else self.peak)

    def limit(self, solver: cp_model.CpSolver) -> int:
        """The bytes no event may exceed in the solver's plan."""
        return self.budget if self.peak is None else solver.value(self.peak)

    def _bool(self, literal: Literal) -> cp_model.IntVar:
        atom = literal[0]
        self.var[atom] = self.cp.new_bool_var("_".join(map(str, atom)))
        return self.var[atom]

    def _literal(self, literal: Literal):
        var = self.var[literal[0]]
        return var if literal[1] else var.Not()

    def hint(self, values: dict[Atom, bool] | None) -> None:
        """Hint the plan `values` describes (none when None)."""
        self.cp.clear_hints()
        for atom, var in self.var.items() if values is not None else ():
            self.cp.add_hint(var, bool(values.get(atom, False)))

    def forbid(self, values: dict[Atom, bool]) -> None:
        """Exclude one plan (one the simulator cannot run)."""
        self.cp.add_bool_or([var.Not() if values[atom] else var for atom, var in self.var.items()])

    def add_rows(self, rows) -> int:
        """Add the rows not in the model yet; how many were added."""
        added = 0
        for row in rows:
            if (row.stage, row.node, row.call) in self.rows:
                continue
            self.rows.add((row.stage, row.node, row.call))
            self._add(row)
            added += 1
        return added

    def _add(self, row: Row) -> None:
        terms = []
        for size, ways in row.terms:
            if len(ways) == 1 and len(ways[0]) == 1:
                terms.append(size * self._literal(ways[0][0]))
                continue
            live = self.cp.new_bool_var("")
            for way in ways:
                self.cp.add_bool_or([self._literal((atom, not positive)) for atom, positive in way] + [live])
            terms.append(size * live)
        limit = self.budget if self.peak is None else self.peak
        constraint = self.cp.add(sum(terms) + row.constant <= limit)
        if row.when is not None:
            constraint.only_enforce_if(self._literal(row.when))

    def cost_of(self, objective: float) -> float:
        """A plan's cost (seconds) from an objective value or bound of the model."""
        return self.regions.graph.total_cost + objective / self.scale


def _most_bytes(model: RegionModel) -> int:
    """More bytes than any event of any plan holds: every storage twice (original and
    copy), the largest workspace and held bytes, and every call's stashes twice."""
    graph = model.graph
    stashes = sum(stash.rerun_bytes + sum(nbytes for _, _, nbytes in stash.spans) for stash in model.stash.values())
    return int(2 * graph.unit_size.sum() + graph.workspace.max(initial=0) + graph.held.max(initial=0) + stashes)
