"""A lower bound on the recomputation any plan needs under a budget, from memory alone.

At the instant node t is computed in its own stage, every storage unit whose owner ran
before t and that some node after t still reads is either live or must be computed again
after t; the units t reads or writes, the parameters and inputs, and the outputs made so
far are live for certain. Where those bytes (with t's workspace) exceed the budget, some
of the others must be recomputed, each at the cost of the op that computes it (spread
over its units by bytes, so dropping some of an op's units is never priced above the
op). A unit dropped between two of its uses is computed again before the second, so
drops between different pairs of uses are paid separately. Choosing, per unit and gap
between its uses, whether it is dropped there, the cheapest choice that covers every
instant's excess is a covering problem whose optimum bounds every schedule's extra cost,
since each schedule's drops are one of its solutions. Solvers use it where their own
bound is weaker: CP-SAT's proves little on graphs of a few hundred nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from optremat.graph import Graph

COVER_NONZEROS = 2_000_000
"""Covering problems larger than this are replaced by their strongest single row (the
bound of the worst instant alone), which needs no solver."""
COVER_SECONDS = 5.0
"""SCIP's longest limit; it then gives the bound it has proved so far."""
COVER_SHARE = 0.25
"""Most of a solver's time limit its covering bound may take."""


@dataclass(frozen=True)
class _Rows:
    """Per instant with an excess: the (unit, gap between uses) pairs that may be dropped
    there, and the excess; per pair, its unit's cost per byte and size."""

    cost_per_byte: np.ndarray
    size: np.ndarray
    rows: list[tuple[np.ndarray, float]]
    infeasible: bool


def recompute_lower_bound(graph: Graph, budget: int, seconds: float = COVER_SECONDS) -> float:
    """A lower bound on the extra cost (beyond one computation of every node) of any
    schedule whose peak is at most `budget` bytes; `inf` when some instant cannot fit at
    all. The covering problem gets at most `seconds`."""
    found = _rows(graph, budget)
    if found.infeasible:
        return float("inf")
    if not found.rows:
        return 0.0
    single = max(_cover(found.cost_per_byte[units], found.size[units], excess) for units, excess in found.rows)
    if sum(len(units) for units, _ in found.rows) > COVER_NONZEROS:
        return single
    return max(single, _covering_program(found, seconds))


def _rows(graph: Graph, budget: int) -> _Rows:
    units = np.nonzero(graph.unit_size > 0)[0]
    size = graph.unit_size[units].astype(np.float64)
    op = np.where(graph.is_part[units], graph.alias_of[units], units)
    op_bytes = np.bincount(op, weights=size, minlength=graph.n)
    cost_per_byte = graph.cost[op] / np.maximum(op_bytes[op], 1.0)
    position = {int(u): k for k, u in enumerate(units)}
    last = op.copy()
    made_output = np.full(len(units), graph.n)
    used_at: list[set[int]] = [set() for _ in range(graph.n)]
    for h in range(graph.n):
        read_until = max(graph.succs[h].tolist(), default=h)
        for u in graph.units[h]:
            k = position.get(u)
            if k is not None:
                last[k] = max(last[k], read_until)
                if graph.output[h]:
                    made_output[k] = min(made_output[k], h)
                for w in graph.succs[h].tolist() + [h]:
                    used_at[w].add(k)
    uses = np.zeros(len(units), dtype=np.int64)
    for w in range(graph.n):
        uses[list(used_at[w])] += 1
    first_gap = np.concatenate([[0], np.cumsum(uses + 1)[:-1]])
    gap_unit = np.repeat(np.arange(len(units)), uses + 1)
    passed = np.zeros(len(units), dtype=np.int64)
    resident = graph.pinned[op]
    rows = []
    for t in range(graph.n):
        if t:
            passed[list(used_at[t - 1])] += 1
        if graph.pinned[t]:
            continue
        must = resident | (made_output <= t)
        for h in graph.preds[t].tolist() + [t]:
            for u in graph.units[h]:
                if u in position:
                    must[position[u]] = True
        crossing = np.nonzero((op < t) & (last > t) & ~must)[0]
        excess = float(size[must & (op <= t)].sum() + size[crossing].sum()) + float(graph.workspace[t]) - budget
        if excess > 0:
            if size[crossing].sum() < excess:
                return _Rows(cost_per_byte, size, [], True)
            rows.append((first_gap[crossing] + passed[crossing], excess))
    return _Rows(cost_per_byte[gap_unit], size[gap_unit], rows, False)


def _cover(cost_per_byte: np.ndarray, size: np.ndarray, excess: float) -> float:
    """Cheapest fractional choice of units covering `excess` bytes (cheapest bytes first)."""
    order = np.argsort(cost_per_byte, kind="stable")
    freed = np.cumsum(size[order])
    whole = int(np.searchsorted(freed, excess))
    paid = float((cost_per_byte * size)[order][:whole].sum())
    return paid + (excess - (freed[whole - 1] if whole else 0.0)) * float(cost_per_byte[order][whole])


def _covering_program(found: _Rows, seconds: float) -> float:
    """The covering problem's least cost with every drop whole, as SCIP proves it within
    `seconds`: its dual bound, shaded by its tolerance so it stays a bound (0 when SCIP
    proves nothing). Whole drops matter: the LP relaxation half-drops a costly unit where
    any real plan pays for all of it or for a dearer mix of others."""
    solver = pywraplp.Solver.CreateSolver("SCIP")
    solver.SetTimeLimit(max(int(seconds * 1000), 1))
    used = np.unique(np.concatenate([units for units, _ in found.rows]))
    unit_cost = found.cost_per_byte * found.size
    scale = float(unit_cost[used].sum()) or 1.0
    dropped = {int(u): solver.BoolVar(f"x{u}") for u in used.tolist()}
    for units, excess in found.rows:
        solver.Add(solver.Sum([float(found.size[u] / excess) * dropped[u] for u in units.tolist()]) >= 1.0)
    solver.Minimize(solver.Sum([float(unit_cost[u] / scale) * x for u, x in dropped.items()]))
    if solver.Solve() not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE, pywraplp.Solver.NOT_SOLVED):
        return 0.0
    bound = solver.Objective().BestBound()
    return max(0.0, bound - 1e-6) * scale if np.isfinite(bound) else 0.0


def solver_floor(graph: Graph, budget: int, time_limit: float, share: bool) -> float:
    """The `recompute_lower_bound` a solver limited to `time_limit` seconds starts from;
    0 with `share`, which the bound does not model."""
    return 0.0 if share else recompute_lower_bound(graph, budget, min(COVER_SECONDS, COVER_SHARE * time_limit))


def tighten(graph: Graph, cost: float, lower_bound: float, optimal: bool, extra: float) -> tuple[float, bool]:
    """A solver's (lower bound, optimal) on total cost, raised by `extra`, a
    `recompute_lower_bound`: a plan whose cost meets the raised bound is optimal whatever
    the solver proved."""
    bound = max(lower_bound, graph.total_cost + extra)
    return bound, optimal or cost <= bound + 1e-9 * graph.total_cost
