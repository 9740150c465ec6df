"""Checkmate's MILP (Jain et al., MLSys 2020) and its LP relaxation with rounding.

Binary R[t,i] computes node i in stage t, S[t,i] keeps tensor i into stage t,
FREE[t,i,k] frees tensor i right after node k runs in stage t; U[t,k] is the memory
when node k is allocated in stage t. Stage t computes node t (the frontier advances one
node a stage). Memory is counted per node: a node holds the bytes of every storage unit
it can keep alive, so where views or multi-output ops share storage the model counts
it more than once and is conservative; on graphs where each node owns its output it
prices exactly what `simulate` does.

With `share`, Z[t,k] lets op k write over the input `Graph.shareable` names when that
input owns its storage outright, has no views, and is freed right after k in stage t:
k then allocates nothing and the input's bytes pass to k instead of being freed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from optremat.core.budget import InfeasibleBudget
from optremat.core.graph import Graph
from optremat.core.schedule import Schedule, from_computations, from_kept, simulate
from optremat.core.solution import FEASIBLE, HEURISTIC, OPTIMAL, Solution
from optremat.ilp.bounds import solver_floor, tighten
from optremat.ilp.cpsat import infeasible
from optremat.ilp.search import seconds_left

BACKENDS = ("SCIP", "CBC", "CP_SAT", "HIGHS")


@dataclass
class _Checkmate:
    solver: pywraplp.Solver
    R: dict[tuple[int, int], pywraplp.Variable]
    S: dict[tuple[int, int], pywraplp.Variable]
    Z: dict[tuple[int, int], pywraplp.Variable]


def _model(graph: Graph, budget: int, backend: str, integral: bool, share: bool = False) -> _Checkmate:
    solver = pywraplp.Solver.CreateSolver(backend)
    if solver is None:
        raise ValueError(f"OR-Tools has no {backend} backend here; choose one of {BACKENDS}")
    n = graph.n
    ops = [i for i in range(n) if not graph.pinned[i]]
    size = np.array([sum(int(graph.unit_size[u]) for u in graph.units[i]) for i in range(n)])
    capacity = budget - graph.pinned_bytes
    new = solver.BoolVar if integral else (lambda name: solver.NumVar(0, 1, name))
    R = {(t, i): new(f"R{t}_{i}") for t in range(n) for i in ops if i <= t}
    S = {(t, i): new(f"S{t}_{i}") for t in range(n) for i in ops if i < t}
    for t in range(n):
        if not graph.pinned[t]:
            solver.Add(R[t, t] == 1)
        for i in ops:
            if i < t:
                solver.Add(R[t, i] + S[t, i] <= 1)
                solver.Add(S[t, i] <= R[t - 1, i] + (S[t - 1, i] if i < t - 1 else 0))
                if graph.output[i]:
                    solver.Add(S[t, i] == 1)
            if i <= t:
                for j in graph.preds[i].tolist():
                    if not graph.pinned[j]:
                        solver.Add(R[t, i] <= R[t, j] + (S[t, j] if j < t else 0))
    viewed = set(graph.alias_of[graph.alias_of >= 0].tolist())
    source = [int(p) if p >= 0 and graph.alias_of[p] < 0 and p not in viewed else -1 for p in graph.shareable] \
        if share else [-1] * n
    Z = {}
    for t in range(n):
        memory = solver.Sum([int(size[i]) * S[t, i] for i in ops if i < t])
        for k in ops:
            if k > t:
                break
            free = {}
            for i in set(graph.preds[k].tolist()) | {k}:
                if graph.pinned[i] or graph.output[i]:
                    continue
                later = [R[t, j] for j in graph.succs[i].tolist() if k < j <= t]
                hazards = [1 - R[t, k]] + ([S[t + 1, i]] if t + 1 < n else []) + later
                free[i] = new(f"F{t}_{i}_{k}")
                solver.Add(len(hazards) * free[i] + solver.Sum(hazards) <= len(hazards))
            taken = 0
            if source[k] in free:
                taken = Z[t, k] = new(f"Z{t}_{k}")
                solver.Add(taken <= free[source[k]])
            allocated = memory + int(size[k]) * (R[t, k] - taken)
            solver.Add(allocated + int(graph.workspace[k]) * R[t, k] <= capacity)
            memory = allocated - solver.Sum([int(size[i]) * f for i, f in free.items()]) + int(size[k]) * taken
    solver.Minimize(solver.Sum([float(graph.cost[i]) * r for (_, i), r in R.items()]))
    return _Checkmate(solver, R, S, Z)


def solve_milp(graph: Graph, budget: int, *, time_limit: float = 30.0, hint: Schedule | None = None,
               backend: str = "SCIP", workers: int = 0, share: bool = False) -> Solution:
    """Checkmate's optimal schedule under `budget` bytes (see the module docstring for
    how shared storage is counted), with in-place shares as decisions when `share`.
    Raises InfeasibleBudget or TimeoutError like cpsat."""
    started = time.perf_counter()
    if budget < graph.pinned_bytes:
        raise InfeasibleBudget(budget, graph.pinned_bytes, "ilp", proven=True)
    extra = solver_floor(graph, budget, time_limit, share)
    model = _model(graph, budget, backend, integral=True, share=share)
    solver = model.solver
    solver.SetTimeLimit(int(seconds_left(time_limit, started) * 1000))
    if workers:
        solver.SetNumThreads(workers)
    if hint is not None:
        computed = {(s, i) for i, s, _ in hint.events}
        solver.SetHint(list(model.R.values()), [float(key in computed) for key in model.R])
    status = solver.Solve()
    if status == pywraplp.Solver.INFEASIBLE:
        raise infeasible(graph, budget, "ilp", time_limit, share=share, workers=workers)
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        raise TimeoutError(f"ilp ({backend}) found no plan within {time_limit:g} s; allow more time or a larger budget")
    schedule = from_computations(graph, [(i, t) for (t, i), r in model.R.items() if t != i and r.solution_value() > 0.5])
    shared = {schedule.event_index[k, t]: int(graph.shareable[k])
              for (t, k), z in model.Z.items() if z.solution_value() > 0.5}
    cost = simulate(graph, schedule, share=frozenset(shared)).cost
    bound, optimal = solver.Objective().BestBound(), status == pywraplp.Solver.OPTIMAL
    if not share:
        bound, optimal = tighten(graph, cost, bound, optimal, extra)
    return Solution(schedule=schedule, solver="ilp", status=OPTIMAL if optimal else FEASIBLE, cost=cost,
                    lower_bound=bound, seconds=time.perf_counter() - started, shared=shared)


def solve_lp_rounding(graph: Graph, budget: int, *, backend: str = "GLOP", thresholds: int = 20) -> Solution:
    """Checkmate's two-phase approximation: solve the LP relaxation, keep every tensor the
    LP mostly keeps (swept over `thresholds` cut-offs), recompute the rest, and return the
    cheapest rounded schedule that `simulate` finds within budget."""
    started = time.perf_counter()
    model = _model(graph, budget, backend, integral=False)
    status = model.solver.Solve()
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        raise infeasible(graph, budget, "lp-rounding", 10.0)
    span = np.array([max(graph.succs[i].tolist(), default=i) - i for i in range(graph.n)])
    kept_share = np.zeros(graph.n)
    for (t, i), s in model.S.items():
        kept_share[i] += s.solution_value() / max(span[i], 1)
    best, smallest = None, None
    for threshold in np.unique(np.concatenate([np.linspace(0, 1, thresholds), kept_share])):
        schedule = from_kept(graph, kept_share >= threshold - 1e-9)
        result = simulate(graph, schedule)
        smallest = min(smallest or result.peak_bytes, result.peak_bytes)
        if result.peak_bytes <= budget and (best is None or result.cost < best[1]):
            best = (schedule, result.cost)
    if best is None:
        raise InfeasibleBudget(budget, smallest, "lp-rounding")
    return Solution(schedule=best[0], solver="lp-rounding", status=HEURISTIC, cost=best[1],
                    lower_bound=None, seconds=time.perf_counter() - started)
