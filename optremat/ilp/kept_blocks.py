"""Keep sets of a chain of identical blocks, solved on one block and composed.

A compiled step's joint graph is planned op by op, and on a 32-layer transformer that
graph has 7,000 nodes: a search over all of them at once does not finish in its time
limit, while every layer is the same computation. Here the forward ops are grouped by
the module that ran them (`Graph.module`, `prefix.<index>`), and the longest run of
consecutive blocks whose ops are alike (`find_blocks`: the same ops on the same sizes,
reading each other in the same places) is a chain. One block of it (the middle one) is
solved on its own (`block_options`): for a grid of caps on the bytes it keeps for the
backward, the keep set that recomputes the least under the cap, with CP-SAT, the
block's inputs taken as available. Those keep sets are the options; `compose` gives
every block of the chain one of them (the same one, then the next larger one for the
last blocks, which run their backward first beside everything the others keep), each
choice priced whole by the caller, and keeps the cheapest that fits.

Every plan returned is priced on the whole step as it runs, so nothing is assumed of the
blocks but their likeness: the options only choose which plans are priced. No bound
comes with them: the step's op-level plans may recompute an op several times, and the
ops outside the chain are kept as `base` keeps them.
"""

from __future__ import annotations

import bisect
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np
from ortools.sat.python import cp_model

from optremat.core.deadline import ends_before
from optremat.core.graph import Graph
from optremat.ilp.search import configure

MIN_BLOCKS = 4
"""The fewest alike blocks composed: below, the op-level search handles the step whole."""
CAPS = 12
"""Caps on the bytes a block keeps, evenly from the least to what keeping every tensor
its backward reads holds; each solved for the cheapest keep set under it."""
PROBES = 6
"""The most levels `compose` prices between the smallest and the largest."""
SCALE = 10**6
"""Recompute costs are scaled to integers of this resolution relative to the largest."""
_INDEXED = re.compile(r"^(?:(.*?)\.)??(\d+)(?:\.|$)")


@dataclass(frozen=True)
class Blocks:
    """A chain of alike blocks: `nodes[b, p]` is the graph index of the `p`-th forward op
    of block `b` (in graph order), position `p` the same op in every block."""

    prefix: str
    nodes: np.ndarray


@dataclass(frozen=True, eq=False)
class Option:
    """A keep mask over a block's positions and the bytes it keeps for the backward."""

    kept: np.ndarray
    bytes: int


def find_blocks(graph: Graph) -> Blocks | None:
    """The longest run of at least MIN_BLOCKS consecutive alike blocks among the forward
    ops, grouped by the first indexed component of their module (`layers.3` in
    `model.layers.3.mlp`); None when there is none."""
    groups: dict[tuple[str, int], list[int]] = {}
    for v in np.flatnonzero(~graph.backward & ~graph.pinned).tolist():
        match = _INDEXED.match(graph.module[v])
        if match:
            groups.setdefault((match.group(1) or "", int(match.group(2))), []).append(v)
    best: Blocks | None = None
    for prefix in sorted({p for p, _ in groups}):
        indices = sorted(i for p, i in groups if p == prefix)
        signatures = {i: _signature(graph, groups[prefix, i]) for i in indices}
        common, _ = Counter(signatures.values()).most_common(1)[0]
        run = _longest_run([i for i in indices if signatures[i] == common])
        if len(run) >= MIN_BLOCKS and (best is None or best.nodes.size < len(run) * len(common)):
            best = Blocks(prefix, np.array([groups[prefix, i] for i in run], dtype=np.int64))
    return best


def _signature(graph: Graph, nodes: list[int]) -> tuple:
    """What must agree between two blocks for one's keep set to mean the same in the
    other: each op, its size, and which of the block's ops it reads and views."""
    position = {v: p for p, v in enumerate(nodes)}
    return tuple((graph.ops[v], int(graph.size[v]), position.get(int(graph.alias_of[v]), -1),
                  tuple(position.get(u, -1) for u in graph.preds[v].tolist())) for v in nodes)


def _longest_run(indices: list[int]) -> list[int]:
    """The longest run of consecutive integers in sorted `indices`."""
    best: list[int] = []
    run: list[int] = []
    for i in indices:
        run = run + [i] if run and i == run[-1] + 1 else [i]
        if len(run) > len(best):
            best = run
    return best


def block_options(graph: Graph, blocks: Blocks, once: np.ndarray, time_limit: float = 5.0,
                  deterministic: bool = False) -> list[Option]:
    """A block's options, from the most bytes kept to the least: for each of CAPS caps,
    the keep set of the middle block that recomputes the least (then keeps the fewest
    bytes at that cost) with at most the cap's bytes kept for the backward. A tensor the
    backward reads is kept or recomputed, and a recomputed one's inputs in the block are
    too; a tensor ops outside the block read (its output, the next block's input) is
    kept, so what the block reads from outside is available; the ops in `once` are never
    recomputed. The solves share `time_limit` seconds, or with `deterministic` each
    solve has that much deterministic time, so that the options repeat."""
    problem = _BlockProblem(graph, blocks.nodes[len(blocks.nodes) // 2], once)
    started = time.perf_counter()

    def solve(cap: int | None, free: bool = False) -> np.ndarray | None:
        return problem.solve(cap, free, lambda solver: configure(solver, time_limit, started, 1, 0, deterministic))

    least = solve(None)
    most = solve(None, free=True)
    if least is None or most is None:
        return []
    low, high = problem.bytes_of(least), problem.bytes_of(most)
    found = {most.tobytes(): most, least.tobytes(): least}
    for cap in np.linspace(low, high, CAPS)[1:-1]:
        kept = solve(int(cap))
        if kept is not None:
            found.setdefault(kept.tobytes(), kept)
    options = [Option(kept, problem.bytes_of(kept)) for kept in found.values()]
    return sorted(options, key=lambda o: -o.bytes)


class _BlockProblem:
    """The CP-SAT model of one block's keep set (see `block_options`)."""

    def __init__(self, graph: Graph, template: np.ndarray, once: np.ndarray) -> None:
        self.template = template
        position = {int(v): p for p, v in enumerate(template.tolist())}
        units = sorted({u for v in template.tolist() for u in graph.units[v] if u in position})
        self.unit_size = {u: int(graph.unit_size[u]) for u in units}
        self.units_of = [[u for u in graph.units[v] if u in position] for v in template.tolist()]
        self.needed = [bool(graph.backward[graph.succs[v]].any()) for v in template.tolist()]
        self.exits = [any(not graph.backward[u] and u not in position for u in graph.succs[v].tolist())
                      for v in template.tolist()]
        self.inner_preds = [[position[u] for u in graph.preds[v].tolist() if u in position]
                            for v in template.tolist()]
        top = max(float(graph.cost[template].max()), 1e-30)
        self.cost = [round(float(c) / top * SCALE) for c in graph.cost[template]]
        self.once = once[template].tolist()

    def bytes_of(self, kept: np.ndarray) -> int:
        held = {u for p in np.flatnonzero(kept).tolist() for u in self.units_of[p]}
        return sum(self.unit_size[u] for u in held)

    def solve(self, cap: int | None, free: bool, configured: Callable[[cp_model.CpSolver], None]
              ) -> np.ndarray | None:
        """The keep mask of least recompute under `cap` bytes (least bytes at that cost);
        with no cap, of least bytes, or with `free` of least bytes recomputing nothing."""
        model = cp_model.CpModel()
        n = len(self.template)
        available = [model.new_bool_var(f"a{p}") for p in range(n)]
        kept = [model.new_bool_var(f"k{p}") for p in range(n)]
        held = {u: model.new_bool_var(f"h{u}") for u in self.unit_size}
        for p in range(n):
            model.add_implication(kept[p], available[p])
            if self.needed[p]:
                model.add(available[p] == 1)
            if self.exits[p]:
                model.add(kept[p] == 1)
            if self.once[p] or free:
                model.add_implication(available[p], kept[p])
            for q in self.inner_preds[p]:
                model.add_bool_or([available[p].Not(), kept[p], available[q]])
            for u in self.units_of[p]:
                model.add_implication(kept[p], held[u])
        size = sum(self.unit_size[u] * h for u, h in held.items())
        recompute = sum(c * (a - k) for c, a, k in zip(self.cost, available, kept))
        if cap is not None:
            model.add(size <= cap)
            model.minimize(recompute * (sum(self.unit_size.values()) + 1) + size)
        else:
            model.minimize(size * (sum(self.cost) + 1) + recompute)
        solver = cp_model.CpSolver()
        configured(solver)
        if solver.solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        return np.array([solver.boolean_value(k) for k in kept], dtype=bool)


Price = Callable[[np.ndarray], int]
"""The peak bytes of the step run with a keep mask over all its nodes."""


def compose(blocks: Blocks, options: list[Option], base: np.ndarray, budget_bytes: int, price: Price,
            deadline: float | None = None) -> np.ndarray | None:
    """The cheapest keep mask found that fits `budget_bytes`: `base` with every block of
    the chain given an option (options ordered from the most bytes kept, the cheapest),
    on the assumption that keeping more never costs more.

    The choices tried are levels (`_levels`): one option given to every block, then the
    next larger option given to the last blocks, one more each level (the last blocks
    run their backward first, beside what every other block keeps), so that the bytes
    the blocks keep grow and their recomputation shrinks from level to level. The
    smallest and largest levels are priced, then levels between a fitting and a
    failing one, each where a line through their peaks meets the budget (at most
    PROBES, none that would end past `deadline`, a `time.perf_counter` time, if it took
    as long as the last). None when the smallest level does not fit."""
    count = len(blocks.nodes)
    levels = _levels([o.bytes for o in options], count)
    kept_bytes = [k for k, _, _ in levels]

    took = 0.0

    def peak(level: int) -> int:
        nonlocal took
        begun = time.perf_counter()
        priced = price(_mask(blocks, options, base, *levels[level][1:]))
        took = time.perf_counter() - begun
        return priced

    low, high = 0, len(levels) - 1
    peaks = {low: peak(low)}
    if peaks[low] > budget_bytes:
        return None
    if high > low:
        peaks[high] = peak(high)
        if peaks[high] <= budget_bytes:
            low = high
    for _ in range(PROBES):
        if high - low <= 1 or not ends_before(deadline, took):
            break
        target = kept_bytes[low] + ((budget_bytes - peaks[low]) * (kept_bytes[high] - kept_bytes[low])
                                    / (peaks[high] - peaks[low]))
        at = min(max(bisect.bisect_right(kept_bytes, target) - 1, low + 1), high - 1)
        peaks[at] = peak(at)
        low, high = (at, high) if peaks[at] <= budget_bytes else (low, at)
    return _mask(blocks, options, base, *levels[low][1:])


def _levels(sizes: list[int], count: int) -> list[tuple[int, int, int]]:
    """(bytes the blocks keep, option, blocks given the next larger option) for every
    level, ascending: `sizes` are the options' bytes, from the largest."""
    smallest = len(sizes) - 1
    levels = [(count * sizes[o] + t * (sizes[o - 1] - sizes[o]), o, t)
              for o in range(smallest, 0, -1) for t in range(count)]
    return levels + [(count * sizes[0], 0, 0)]


def _mask(blocks: Blocks, options: list[Option], base: np.ndarray, option: int, larger: int) -> np.ndarray:
    """`base` with every block given `option`, but the last `larger` blocks the next
    larger option."""
    kept = base.copy()
    count = len(blocks.nodes)
    for b, nodes in enumerate(blocks.nodes):
        kept[nodes] = options[option - 1 if b >= count - larger else option].kept
    return kept
