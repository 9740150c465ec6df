"""A lower bound on the recomputation any plan needs under a budget, from memory alone.

At the instant node t is computed in its own stage, every storage unit whose owner ran
before t and that some node after t still reads is either live or must be computed again
after t; the units t reads or writes, the parameters and inputs, and the outputs made so
far are live for certain. Where those bytes (with t's workspace) exceed the budget, some
of the others must be recomputed, each at the cost of the op that computes it (spread
over its units by bytes, so dropping some of an op's units is never priced above the
op). A unit dropped between two of its uses is computed again before the second, so
drops between different pairs of uses are paid separately. Choosing, per unit and gap
between its uses, whether it is dropped there, the cheapest choice of whole drops that
covers every instant's excess bounds every schedule's extra cost, since each schedule's
drops are one of its choices.

Recomputing a unit needs its op's inputs, and an input no original node reads any more
(a projection whose only reader ran in the forward pass) must then have stayed live
since its last read, or be computed again at its own op's cost. So a unit dropped at
an instant after such an input's last read and computed again later keeps that input's
bytes live at the instant unless the input is paid for. That is what makes the bound
count the inputs a recomputation drags across the peak: on gpt-small at 70% it rises
from 5.83% to 7.65%, against plans of 7.66%.

Solvers use the bound where their own is weaker: CP-SAT's proves little on graphs of a
few hundred nodes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from optremat.core.graph import Graph

COVER_NONZEROS = 2_000_000
"""Covering problems larger than this are replaced by their strongest single row (the
bound of the worst instant alone), which needs no solver."""
COVER_SECONDS = 5.0
"""SCIP's longest limit over both covering programs; each gives the bound it has proved
so far when its time runs out."""
HOLD_TERMS = 100_000
"""Covering programs with more drop and hold terms than this leave the holds out: on the
1,000-node random layered graph (450,000 terms at m = 0.8) building them alone outlasts
the time limit, and SCIP proves less in 5 s than without them."""
COVER_SHARE = 0.25
"""Most of a solver's time limit its covering bound may take."""


@dataclass(frozen=True)
class _Row:
    """One instant with an excess: the (unit, gap between uses) pairs that may be dropped
    there, the excess in bytes, and the (pair, unit) couples where recomputing the pair's
    unit after this instant keeps the other unit, an input nothing else reads any more,
    live here unless that input is computed again."""

    drops: np.ndarray
    excess: float
    holds: list[tuple[int, int]]


@dataclass(frozen=True)
class _Rows:
    """The instants with an excess; per (unit, gap) pair its unit's cost per byte and
    size; per unit its cost and size."""

    cost_per_byte: np.ndarray
    size: np.ndarray
    unit_cost: np.ndarray
    unit_size: np.ndarray
    rows: list[_Row]
    infeasible: bool


def recompute_lower_bound(graph: Graph, budget: int, seconds: float = COVER_SECONDS) -> float:
    """A lower bound on the extra cost (beyond one computation of every node) of any
    schedule whose peak is at most `budget` bytes; `inf` when some instant cannot fit at
    all. The covering problems get at most `seconds`, reading the graph's instants and
    building them included: past that, the strongest single row's bound stands (on a
    64-layer Llama's joint graph, 14,411 nodes, building alone had taken 10 s of a 2.5 s
    share)."""
    deadline = time.perf_counter() + seconds
    found = _rows(graph, budget, deadline)
    if found is None:  # the graph's instants were not all read in time: no bound
        return 0.0
    if found.infeasible:
        return float("inf")
    if not found.rows:
        return 0.0
    single = max(_cover(found.cost_per_byte[row.drops], found.size[row.drops], row.excess) for row in found.rows)
    terms = sum(len(row.drops) for row in found.rows)
    if terms > COVER_NONZEROS or time.perf_counter() >= deadline:
        return single
    bound = max(single, _covering_program(found, deadline, holds=False))
    held = sum(len(row.holds) for row in found.rows)
    if held and terms + held <= HOLD_TERMS and time.perf_counter() < deadline:
        bound = max(bound, _covering_program(found, deadline, holds=True))
    return bound


def _rows(graph: Graph, budget: int, deadline: float = math.inf) -> _Rows | None:
    """The covering rows of `graph` under `budget`; None when `deadline` passes first
    (each instant takes a pass over every unit: minutes on an RNN unrolled to 46,000
    nodes)."""
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
    forgettable = ~resident & (made_output == graph.n)
    inputs = [np.array(sorted({position[u] for p in graph.preds[int(op[k])].tolist() for u in graph.units[p]
                               if u in position and forgettable[position[u]]}), dtype=np.int64)
              for k in range(len(units))]
    rows = []
    for t in range(graph.n):
        if t % 256 == 0 and time.perf_counter() > deadline:
            return None
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
                return _Rows(cost_per_byte, size, cost_per_byte * size, size, [], True)
            drops = first_gap[crossing] + passed[crossing]
            holds = [(int(j), int(y)) for k, j in zip(crossing.tolist(), drops.tolist())
                     for y in inputs[k][(last[inputs[k]] < t) & ~must[inputs[k]]].tolist()]
            rows.append(_Row(drops, excess, holds))
    return _Rows(cost_per_byte[gap_unit], size[gap_unit], cost_per_byte * size, size, rows, False)


def _cover(cost_per_byte: np.ndarray, size: np.ndarray, excess: float) -> float:
    """Cheapest fractional choice of units covering `excess` bytes (cheapest bytes first)."""
    order = np.argsort(cost_per_byte, kind="stable")
    freed = np.cumsum(size[order])
    whole = int(np.searchsorted(freed, excess))
    paid = float((cost_per_byte * size)[order][:whole].sum())
    return paid + (excess - (freed[whole - 1] if whole else 0.0)) * float(cost_per_byte[order][whole])


def _covering_program(found: _Rows, deadline: float, holds: bool) -> float:
    """The covering problem's least cost, with the inputs recomputations hold if `holds`,
    as SCIP proves it by `deadline` (a `time.perf_counter()` time): its dual bound, shaded
    by its tolerance so it stays a bound (0 when SCIP proves nothing, or when building the
    program runs past the deadline).

    With `holds`, a pair that holds an input gets one variable per instant, "dropped here and computed
    again later", which never rises again within its gap (a schedule's last recomputation
    of the unit before the gap's end splits the gap into instants before it and after);
    every other pair needs one variable for its whole gap. Drops are whole: the LP
    relaxation half-drops a costly unit where any real plan pays for all of it or for a
    dearer mix of others."""
    solver = pywraplp.Solver.CreateSolver("SCIP")
    used = np.unique(np.concatenate([row.drops for row in found.rows]))
    scale = float((found.cost_per_byte * found.size)[used].sum()) or 1.0
    timed = {j for row in found.rows for j, _ in row.holds} if holds else set()
    whole: dict[int, pywraplp.Variable] = {}
    first: dict[int, pywraplp.Variable] = {}
    latest: dict[int, pywraplp.Variable] = {}
    recomputed: dict[int, pywraplp.Variable] = {}

    def dropped(j: int) -> pywraplp.Variable:
        if j not in timed:
            if j not in whole:
                whole[j] = solver.BoolVar("")
            return whole[j]
        x = solver.BoolVar("")
        if j in latest:
            solver.Add(x <= latest[j])
        first.setdefault(j, x)
        latest[j] = x
        return x

    for k, row in enumerate(found.rows):
        if k % 64 == 0 and time.perf_counter() >= deadline:
            return 0.0
        here = {j: dropped(j) for j in row.drops.tolist()}
        held: dict[int, pywraplp.Variable] = {}
        for j, y in row.holds if holds else ():
            if y not in recomputed:
                recomputed[y] = solver.BoolVar("")
            if y not in held:
                held[y] = solver.NumVar(0.0, 1.0, "")
            solver.Add(held[y] >= here[j] - recomputed[y])
        solver.Add(solver.Sum([float(found.size[j] / row.excess) * x for j, x in here.items()])
                   - solver.Sum([float(found.unit_size[y] / row.excess) * h for y, h in held.items()]) >= 1.0)
    pay = [(float(found.cost_per_byte[j] * found.size[j]), x) for j, x in (whole | first).items()]
    pay += [(float(found.unit_cost[y]), r) for y, r in recomputed.items()]
    solver.Minimize(solver.Sum([cost / scale * x for cost, x in pay]))
    solver.SetTimeLimit(max(int((deadline - time.perf_counter()) * 1000), 1))
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
