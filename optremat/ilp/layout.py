"""Memory layout: an offset in one arena for every allocation of a schedule.

The live-bytes peak that `simulate()` reports is what a perfect allocator would need.
A real one places each tensor at an address, and tensors alive at the same time must not
overlap, so holes left by freed tensors fragment the arena (the dynamic storage
allocation problem). Given the allocations' sizes and lifetimes, `greedy_layout` places
the largest first in a free gap among those alive with it (the greedy-by-size strategy
of Caffe2's memonger and TFLite's arena planner, first-fit and best-fit), and
`cpsat_layout` solves the placement exactly as a 2-D no-overlap problem (time × address)
with CP-SAT, hinted with the greedy layout so it is never worse.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from optremat.core.graph import Graph
from optremat.core.schedule import Schedule, simulate
from optremat.core.solution import FEASIBLE, HEURISTIC, OPTIMAL

ALIGNMENT = 64
"""Bytes every allocation is rounded up to, as allocators align blocks."""


@dataclass(frozen=True, eq=False)
class Layout:
    """Offsets for allocations (rows of bytes, first, end over the schedule's computations).

    `arena_bytes` is the address range the layout needs; `live_bytes` the most bytes alive
    at once (the lower bound any layout has to meet); both after alignment. `status`
    says whether `arena_bytes` is proven least (OPTIMAL), a solver's best within its time
    limit (FEASIBLE) or the greedy result (HEURISTIC).
    """

    sizes: np.ndarray
    first: np.ndarray
    end: np.ndarray
    offsets: np.ndarray
    arena_bytes: int
    live_bytes: int
    method: str
    status: str
    seconds: float

    @property
    def fragmentation(self) -> float:
        """Arena bytes beyond the live-bytes bound, as a fraction of the bound."""
        return self.arena_bytes / self.live_bytes - 1 if self.live_bytes else 0.0

    def overlapping(self) -> tuple[int, int] | None:
        """Two allocations alive at the same time whose address ranges overlap, or None."""
        order = np.argsort(self.first, kind="stable")
        for a_pos, a in enumerate(order.tolist()):
            for b in order[a_pos + 1:].tolist():
                if self.first[b] >= self.end[a]:
                    break
                if self.offsets[a] < self.offsets[b] + self.sizes[b] and self.offsets[b] < self.offsets[a] + self.sizes[a]:
                    return a, b
        return None


def allocations(graph: Graph, schedule: Schedule, alignment: int = ALIGNMENT) -> np.ndarray:
    """Rows (bytes rounded up to `alignment`, first, end) of every nonempty allocation."""
    table = simulate(graph, schedule, allocations=True).allocations
    table = table[table[:, 0] > 0].copy()
    table[:, 0] = -(-table[:, 0] // alignment) * alignment
    return table


def live_bytes(table: np.ndarray) -> int:
    """The most bytes alive at once among the allocations."""
    if not len(table):
        return 0
    horizon = int(table[:, 2].max()) + 1
    delta = np.zeros(horizon + 1, dtype=np.int64)
    np.add.at(delta, table[:, 1], table[:, 0])
    np.add.at(delta, table[:, 2], -table[:, 0])
    return int(np.cumsum(delta).max())


def greedy_layout(table: np.ndarray) -> Layout:
    """Largest allocation first (ties: longest-lived first, or earliest first), each in the
    lowest gap, or the tightest gap, free throughout its lifetime; the best of the four."""
    started = time.perf_counter()
    sizes, first, end = (table[:, k].astype(np.int64) for k in range(3))
    orders = (np.lexsort((first, -sizes)), np.lexsort((first, -(end - first), -sizes)))
    candidates = [_place(sizes, first, end, order, tightest) for order in orders for tightest in (False, True)]
    offsets = min(candidates, key=lambda o: int((o + sizes).max(initial=0)))
    offsets.setflags(write=False)
    return Layout(sizes, first, end, offsets, int((offsets + sizes).max(initial=0)), live_bytes(table), "greedy",
                  HEURISTIC, time.perf_counter() - started)


def _place(sizes: np.ndarray, first: np.ndarray, end: np.ndarray, order: np.ndarray, tightest: bool) -> np.ndarray:
    offsets = np.full(len(sizes), -1, dtype=np.int64)
    placed = np.zeros(len(sizes), dtype=bool)
    for i in order.tolist():
        others = np.nonzero(placed & (first < end[i]) & (end > first[i]))[0]
        others = others[np.argsort(offsets[others], kind="stable")]
        ends = offsets[others] + sizes[others]
        below = np.maximum.accumulate(np.concatenate(([0], ends)))  # the top of what lies below each, and of all
        gaps = offsets[others] - below[:-1]
        fits = np.flatnonzero(gaps >= sizes[i])
        if not len(fits):
            offsets[i] = below[-1]
        else:
            offsets[i] = below[fits[np.argmin(gaps[fits])] if tightest else fits[0]]
        placed[i] = True
    return offsets


def cpsat_layout(table: np.ndarray, *, time_limit: float = 10.0, workers: int = 0, seed: int = 0,
                 hint: Layout | None = None) -> Layout:
    """The least arena for the allocations: CP-SAT over offsets with a 2-D no-overlap
    constraint, hinted with (and never worse than) the greedy layout."""
    started = time.perf_counter()
    greedy = hint if hint is not None else greedy_layout(table)
    bound = greedy.live_bytes
    if greedy.arena_bytes <= bound or not len(table):
        return _relabel(greedy, "cpsat", OPTIMAL, time.perf_counter() - started)
    unit = int(np.gcd.reduce(table[:, 0]))
    sizes = (table[:, 0] // unit).tolist()
    top = greedy.arena_bytes // unit
    model = cp_model.CpModel()
    arena = model.new_int_var(bound // unit, top, "arena")
    x_intervals, y_intervals, offsets = [], [], []
    for k, (size, first, end) in enumerate(zip(sizes, table[:, 1].tolist(), table[:, 2].tolist())):
        offset = model.new_int_var(0, top - size, f"offset{k}")
        model.add(offset + size <= arena)
        offsets.append(offset)
        x_intervals.append(model.new_fixed_size_interval_var(first, end - first, f"t{k}"))
        y_intervals.append(model.new_fixed_size_interval_var(offset, size, f"a{k}"))
        model.add_hint(offset, int(greedy.offsets[k]) // unit)
    model.add_no_overlap_2d(x_intervals, y_intervals)
    model.add_hint(arena, top)
    model.minimize(arena)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE) or solver.value(arena) * unit >= greedy.arena_bytes:
        proven = status == cp_model.OPTIMAL
        return _relabel(greedy, "cpsat", OPTIMAL if proven else FEASIBLE, time.perf_counter() - started)
    found = np.array([solver.value(o) * unit for o in offsets], dtype=np.int64)
    found.setflags(write=False)
    return Layout(greedy.sizes, greedy.first, greedy.end, found, int(solver.value(arena)) * unit, bound, "cpsat",
                  OPTIMAL if status == cp_model.OPTIMAL else FEASIBLE, time.perf_counter() - started)


def layout(graph: Graph, schedule: Schedule, method: str = "greedy", *, time_limit: float = 10.0,
           alignment: int = ALIGNMENT) -> Layout:
    """The arena layout of `schedule`'s allocations by `method` ("greedy" or "cpsat")."""
    if method not in ("greedy", "cpsat"):
        raise ValueError(f"unknown layout method {method!r}; choose greedy or cpsat")
    table = allocations(graph, schedule, alignment)
    return greedy_layout(table) if method == "greedy" else cpsat_layout(table, time_limit=time_limit)


def _relabel(found: Layout, method: str, status: str, seconds: float) -> Layout:
    return Layout(found.sizes, found.first, found.end, found.offsets, found.arena_bytes, found.live_bytes, method,
                  status, seconds)
