"""Region plans of a chain of identical blocks, solved once per block and composed.

Solving 32 copies of one transformer block jointly from scratch is the same work 32
times. Here one block (the middle one) is solved on its own: for a grid of caps on what
it may hold at the step's busiest moment between the forwards and the backwards (the
anchor, where every block holds what it saved), the cheapest plan of regions inside it,
with CP-SAT's proof (`_Frontiers`). The plans of the cells the bound's least choice
takes (below), and of their neighbours, are the options, each priced once on the
simulator with every other block unplanned (`_profile`): its extra seconds, the peaks of
the block's own forward and backward, and what it adds to (or frees from) every other
segment of the step (`Chain.relation`), which is the same for every block of the chain. A
dynamic program along the chain, then (in the second round) a small CP-SAT model, picks
one option per block so that every segment fits the budget at the least extra cost
(`_compose`); the plan is then priced whole on the
simulator and kept only when the simulator agrees with the composition (what one block's
plan does to a segment adds to what another's does).

The bound: at the anchor every block holds its plan's bytes at once, so in a plan that
fits, the blocks' bytes there sum to at most what the budget leaves, and each block
costs at least the cheapest plan under the cap of its grid cell. The least total over
those cells (a knapsack, `_bound`) bounds every plan of regions inside the blocks, not
only the options'.

Planning the same step with its LM head in several chunk counts solves the same block
again and again: a `FrontierMemo`, handed from one count's solve to the next, keeps
each frontier under the content of its CP-SAT model (the block's decisions and their
costs, and the row of bytes at the event, relative to the unplanned step there, with ops
numbered from the block's first), so a frontier is solved once for every step whose model
for it is the same.

Both rest on the blocks being alike: what a block's plan does to a segment depends only
on how the segment stands to the block, and what two blocks' plans do adds up. The
composed plan is priced whole on the simulator, which checks that for it; a bound above
that plan's cost is dropped.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Iterable

import numpy as np
from ortools.sat.python import cp_model

from optremat.core.schedule import InvalidSchedule
from optremat.ilp.region_cpsat import SCALE, _Cp
from optremat.ilp.region_model import OWN, RegionModel, Row
from optremat.ilp.search import configure
from optremat.planners.chain import (AFTER_BACKWARD, AFTER_FORWARD, BACKWARD, BEFORE, END, FORWARD, MIDDLE, Chain,
                                     Segment)
from optremat.planners.regions import Priced, Region, kept_of, price

CELLS = 64
"""Caps on a block's bytes at one event solved for its frontier, evenly from the least
any plan of the block holds there to what the unplanned block holds."""
OPTIONS = 24
"""The most plans of one frontier offered to the composition when its knapsack (the
bound) is not solved, or when the plans of the cells it chose and of their neighbours
compose none (each option costs a simulation of the whole step to profile)."""
COMPOSE_SECONDS = 0.3
"""The most seconds (or deterministic time) the choice of one option per block takes: on
the Llama-7B shape at half and 70% of its unplanned peak, 0.3 s chose what 1 s did, and
`optremat.plan` polishes one choice per LM head chunk count (eight)."""
OWN_PHASES = (FORWARD, BACKWARD)


@dataclass(frozen=True, eq=False)
class Option:
    """One plan of regions inside a block (as regions of the middle block): its extra
    seconds, the peaks of the block's own forward and backward (bytes, where the middle
    block runs them), and per `Chain.relation` the bytes it adds to every other segment."""

    regions: tuple[Region, ...]
    extra: float
    peaks: dict[str, int]
    held: dict[tuple[str, int], int]


@dataclass(frozen=True, eq=False)
class Composed:
    """The composed plan (None when no choice of options fits, or when the simulator
    disagrees with the composition), the least cost (seconds) any plan of regions inside
    the blocks can have under the budget (-inf where none is known), and the options each
    block chose from."""

    priced: Priced | None
    bound: float
    options: tuple[Option, ...]


@dataclass(frozen=True, eq=False)
class _Cell:
    """The plans of a block holding at `least` bytes at a frontier's event (beyond the
    unplanned block's) and up to the cell's cap: each costs at least `cost` extra
    seconds; `plan` is the cheapest under the cap (None when none was found)."""

    least: int
    cost: float
    plan: tuple[Region, ...] | None


@dataclass(frozen=True, eq=False)
class _Timeline:
    """The unplanned step on the chain: its price and bytes per stage, the middle block,
    how far each block's forward and backward run above the middle one's, and the anchor."""

    base: Priced
    curve: np.ndarray
    middle: int
    shift: dict[tuple[str, int], int]
    anchor: int


class FrontierMemo:
    """Frontiers solved so far, by the content of their CP-SAT models (see module): the
    least bytes of each, and its cells."""

    def __init__(self) -> None:
        self.least: dict[tuple, int | None] = {}
        self.cells: dict[tuple, list[_Cell] | None] = {}


def solve_chain(chain: Chain, budget: int, time_limit: float, *, workers: int = 0, seed: int = 0,
                deterministic: bool = False, memo: FrontierMemo | None = None) -> Composed | None:
    """The cheapest composition of per-block options that fits `budget`, with the bound
    on every plan of regions inside the blocks; None when the middle block does not see
    every relation another block needs (a chain of three or four blocks with gaps between
    them) or the step has no gap between the forwards and the backwards.
    The options come from the frontiers at the anchor (the plans of the cells the bound
    chose and their neighbours, or up to OPTIONS plans across the frontier when those
    compose no plan) and
    at the event where the first composed plan peaks; the bound is the better of the
    knapsacks at those two events.
    `memo` keeps the frontiers solved for the next step with the same blocks."""
    timeline = _timeline(chain)
    if timeline is None:
        return None
    frontiers = _frontiers(chain, timeline, (time_limit, workers, seed, deterministic, time.perf_counter()), memo)
    limits = (min(time_limit, COMPOSE_SECONDS), workers, seed, deterministic)
    found: list[tuple[Region, ...]] = []
    bound = _relaxed(chain, timeline, frontiers, timeline.anchor, budget, found)
    profiled: dict[tuple[Region, ...], Option | None] = {}
    options, picked, priced = _round(chain, timeline, found, profiled, budget, limits, None, polish=False)
    cells = frontiers.cells(timeline.anchor) if priced is None and math.isfinite(bound) else None
    if cells is not None:  # near the least peak: options from across the whole frontier
        found.extend(p for p in _near(cells, None) if p not in found)
        options, picked, priced = _round(chain, timeline, found, profiled, budget, limits, None, polish=False)
    if priced is not None:
        bound = max(bound, _relaxed(chain, timeline, frontiers, _peak_stage(priced), budget, found))
        options, picked, again = _round(chain, timeline, found, profiled, budget, limits, picked, polish=True)
        priced = min([p for p in (priced, again) if p is not None], key=lambda p: p.cost)
    bound += chain.rmap.graph.total_cost
    if priced is not None and bound > priced.cost * (1 + 1e-9):
        bound = -math.inf  # a plan below the bound: the blocks' bytes did not add as the bound assumes
    return Composed(priced, bound, tuple(options))


def chain_bound(chain: Chain, budget: int, time_limit: float, *, workers: int = 0, seed: int = 0,
                deterministic: bool = False, memo: FrontierMemo | None = None) -> float:
    """The bound `solve_chain` puts on every plan of regions inside the blocks under
    `budget` (seconds of the whole step; -inf where none is known), from the knapsack at
    the anchor alone: nothing is profiled or composed, so with the frontiers in `memo` it
    costs one simulation of the unplanned step."""
    timeline = _timeline(chain)
    if timeline is None:
        return -math.inf
    frontiers = _frontiers(chain, timeline, (time_limit, workers, seed, deterministic, time.perf_counter()), memo)
    return _relaxed(chain, timeline, frontiers, timeline.anchor, budget, []) + chain.rmap.graph.total_cost


def _frontiers(chain: Chain, timeline: _Timeline, limits: tuple, memo: FrontierMemo | None) -> _Frontiers:
    """The middle block's frontiers, solved under `limits` (seconds, workers, seed,
    deterministic, start) unless `memo` has them."""
    return _Frontiers(RegionModel(chain.rmap, chain.inner[timeline.middle]), timeline, limits,
                      memo or FrontierMemo(), int(chain.rmap.members[chain.blocks[timeline.middle]].min()))


def _round(chain: Chain, timeline: _Timeline, found: list[tuple[Region, ...]],
           profiled: dict[tuple[Region, ...], Option | None], budget: int, limits: tuple,
           hint: list[Option] | None, polish: bool) -> tuple[list[Option], list[Option] | None, Priced | None]:
    """The plans `found` so far profiled (once each, into `profiled`) as options, the
    options no other beats, the choice per block composed from them (with `polish`,
    improved by CP-SAT), and its plan."""
    profiled.update((r, _profile(chain, timeline, r)) for r in dict.fromkeys([(), *found]) if r not in profiled)
    options = _pareto([o for o in profiled.values() if o is not None])
    picked = _compose(chain, timeline, options, budget, *limits, hint, polish)
    return options, picked, None if picked is None else _priced(chain, timeline, picked, budget)


def _priced(chain: Chain, timeline: _Timeline, picked: list[Option], budget: int) -> Priced | None:
    """The plan of one option per block priced whole; None when the simulator finds it
    over the budget or over the composition's peak (the blocks' effects did not add)."""
    regions = tuple(r for k, option in enumerate(picked) for r in chain.moved(option.regions, timeline.middle, k))
    try:
        priced = price(chain.rmap, *kept_of(chain.rmap, regions), "composed")
    except InvalidSchedule:
        return None
    return priced if priced.result.peak_bytes <= min(_peak(chain, timeline, picked), budget) else None


def _timeline(chain: Chain) -> _Timeline | None:
    rmap = chain.rmap
    base = price(rmap, (), np.ones(rmap.graph.n, dtype=bool), "unplanned")
    curve = base.result.curve
    middle = len(chain.blocks) // 2
    if _relations(chain, range(len(chain.blocks))) - _relations(chain, [middle]):
        return None
    own = {(s.kind, s.block): s for s in chain.segments if s.kind in OWN_PHASES}
    shift = {}
    for (kind, k), segment in own.items():
        reference = own[(kind, middle)]
        shift[(kind, k)] = int((curve[segment.first:segment.last + 1] - curve[reference.first:reference.last + 1]).max())
    gap = next((s for s in chain.segments if s.kind == MIDDLE), None)
    if gap is None:
        return None
    anchor = gap.first + int(np.argmax(curve[gap.first:gap.last + 1]))
    return _Timeline(base, curve, middle, shift, anchor)


def _relations(chain: Chain, blocks: Iterable[int]) -> set[tuple[str, int]]:
    """How the segments stand to `blocks`, their own forwards and backwards left out."""
    return {chain.relation(s, k) for k in blocks for s in chain.segments
            if not (s.kind in OWN_PHASES and s.block == k)}


class _Frontiers:
    """Per event of the middle block (a stage), the cheapest plans of the block under a
    grid of caps on its bytes there, and the grid's cells (`cells`); the least bytes any
    plan of the block holds there (`least`). Each solved once: into `memo` when proven
    whole, else for this chain alone (a frontier cut short by this solve's time is no
    answer for a later step with time of its own)."""

    def __init__(self, model: RegionModel, timeline: _Timeline, limits: tuple, memo: FrontierMemo,
                 first: int) -> None:
        self.model, self.timeline, self.limits, self.memo, self.first = model, timeline, limits, memo, first
        self.own = FrontierMemo()
        self._rows: dict[int, tuple[Row, tuple]] = {}
        self._decisions = _decisions(model, first)

    def least(self, stage: int) -> int | None:
        """The least bytes beyond the unplanned block's any plan holds at `stage` (a lower
        bound when not proven), None when the solver found none in time."""
        row, key = self._row(stage)
        found = self.memo.least.get(key, self.own.least.get(key, False))
        if found is False:
            cp = _Cp(self.model, None)
            cp.add_rows([row])
            status, solver = _solve(cp, *self.limits)
            ok = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
            found = math.floor(solver.best_objective_bound) - int(self.timeline.curve[stage]) if ok else None
            (self.memo if status == cp_model.OPTIMAL else self.own).least[key] = found
        return found

    def cells(self, stage: int) -> list[_Cell] | None:
        """The grid's cells at `stage`, by their least bytes (None when the least bytes
        were not found in time; past the time limit the rest is one cell costing 0)."""
        key = self._row(stage)[1]
        found = self.memo.cells.get(key, self.own.cells.get(key, False))
        if found is False:
            found, whole = self._solve_cells(stage)
            (self.memo if whole else self.own).cells[key] = found
        return found

    def _row(self, stage: int) -> tuple[Row, tuple]:
        """The row of the block's bytes at `stage` and its content: the block's decisions
        and the row, relative to the unplanned step's bytes there."""
        if stage not in self._rows:
            row = self.model.row(stage, stage, OWN)
            terms = tuple((size, tuple(tuple((_moved(atom, self.first), on) for atom, on in way) for way in ways))
                          for size, ways in row.terms)
            self._rows[stage] = row, (self._decisions, row.constant - int(self.timeline.curve[stage]), terms)
        return self._rows[stage]

    def _solve_cells(self, stage: int) -> tuple[list[_Cell] | None, bool]:
        """The cheapest plan under each of CELLS caps, evenly from the least bytes any
        plan holds at `stage` to what the unplanned block holds; each cap's cell holds the
        plans above the cap before it, which cost at least what the cheapest under its own
        cap costs. And whether every cap was solved to its proof."""
        model, lowest = self.model, self.least(stage)
        if lowest is None:
            return None, False
        row, unplanned = self._row(stage)[0], int(self.timeline.curve[stage])
        cells, below, whole = [], lowest, True
        for cap in sorted({int(c) for c in np.linspace(lowest, 0, CELLS)}):
            if not self.limits[3] and time.perf_counter() - self.limits[4] > self.limits[0]:
                whole = False
                break
            cp = _Cp(model, unplanned + cap)
            cp.add_rows([row])
            status, solver = _solve(cp, *self.limits)
            whole &= status in (cp_model.OPTIMAL, cp_model.INFEASIBLE)
            if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                plan = model.regions({atom: bool(solver.value(var)) for atom, var in cp.var.items()})
                cells.append(_Cell(below, cp.cost_of(solver.best_objective_bound) - model.graph.total_cost, plan))
            elif status != cp_model.INFEASIBLE:
                cells.append(_Cell(below, 0.0, None))
            below = cap + 1
        cells.append(_Cell(below, 0.0, None))
        return cells, whole


def _decisions(model: RegionModel, first: int) -> tuple:
    """What `_Cp` builds the decisions of `model` from, ops numbered from `first`: the
    candidates, what each may save and recompute at what cost (seconds, before scaling to
    the step), and which exclude each other."""
    graph = model.graph

    def ops(nodes: Iterable[int]) -> tuple[int, ...]:
        return tuple(int(v) - first for v in nodes)

    calls = tuple((c.index, c.call, ops(sorted(c.forced)), c.rerun.cost, c.rerun.policy_looks,
                   ops(model.saveable[c.index]), ops(model.owner[list(c.rerun.recomputable)]),
                   graph.cost[list(c.rerun.recomputable)].tobytes(), ops(model.read_back(c)))
                  for c in model.calls)
    return calls, tuple(tuple(sorted(group)) for group in model.shared), model.rmap.dispatch_seconds


def _moved(atom: tuple[str, int, int], first: int) -> tuple[str, int, int]:
    """A decision with the op it names numbered from `first` (a candidate's own is not an op)."""
    kind, op, call = atom
    return atom if kind == "x" else (kind, op - first, call)


def _near(cells: list[_Cell], chosen: list[int] | None) -> list[tuple[Region, ...]]:
    """The plan holding the least and the plans of the cells `chosen` and of their
    neighbours; at most OPTIONS of every plan, evenly spaced, when none are chosen."""
    plans = [cell.plan for cell in cells]
    if chosen is None:
        found = list(dict.fromkeys(p for p in plans if p is not None))
        if len(found) <= OPTIONS:
            return found
        return [found[round(i * (len(found) - 1) / (OPTIONS - 1))] for i in range(OPTIONS)]
    near = {0} | {j for i in chosen for j in (i - 1, i, i + 1) if 0 <= j < len(cells)}
    return list(dict.fromkeys(plans[j] for j in sorted(near) if plans[j] is not None))


def _peak_stage(priced: Priced) -> int:
    """The stage where `priced` peaks."""
    return int(priced.lowering.schedule.stage[int(np.argmax(priced.result.curve))])


def _relaxed(chain: Chain, timeline: _Timeline, frontiers: _Frontiers, stage: int, budget: int,
             found: list[tuple[Region, ...]]) -> float:
    """A lower bound on the extra cost of any plan of regions inside the blocks under
    `budget`, from the bytes at one stage's own event: each block holds
    there what its plan holds at the same place relative to it, at least its cell's
    least, and costs at least its cell's least cost; a block whose own forward or
    backward the event is in holds at least its least and costs at least nothing. The
    plans the frontiers find join `found`. -inf when the event cannot be read off the
    middle block."""
    segment = next(s for s in chain.segments if s.first <= stage <= s.last)
    groups: dict[int, int] = {}
    room = budget - int(timeline.curve[stage])
    for k in range(len(chain.blocks)):
        aligned = _aligned(chain, timeline, segment, stage, k)
        if aligned is None:
            return -math.inf
        if segment.kind in OWN_PHASES and segment.block == k:
            least = frontiers.least(aligned)
            if least is None:
                return -math.inf
            room -= least
        else:
            groups[aligned] = groups.get(aligned, 0) + 1
    menus = []
    for aligned, count in groups.items():
        cells = frontiers.cells(aligned)
        if cells is None:
            found.extend(p for _, read in menus for p in _near(read, None) if p not in found)
            return -math.inf
        menus.append((count, cells))
    bound, chosen = _bound([(count, [(c.least, c.cost) for c in cells]) for count, cells in menus], room)
    for (_, cells), cells_chosen in zip(menus, chosen or [None] * len(menus)):
        found.extend(p for p in _near(cells, cells_chosen) if p not in found)
    return bound


def _aligned(chain: Chain, timeline: _Timeline, segment: Segment, stage: int, block: int) -> int | None:
    """The stage where the middle block stands as `block` stands to `stage` (in `segment`)."""
    if segment.block < 0:
        return stage
    kind, side = chain.relation(segment, block)
    target = next((s for s in chain.segments if s.kind == kind and s.block == timeline.middle + side), None)
    offset = stage - segment.first
    if target is None or target.last - target.first != segment.last - segment.first:
        return None
    return target.first + offset


def _solve(cp: _Cp, time_limit: float, workers: int, seed: int, deterministic: bool,
           started: float) -> tuple[int, cp_model.CpSolver]:
    solver = cp_model.CpSolver()
    configure(solver, time_limit, started, workers or 1, seed, deterministic)
    solver.parameters.linearization_level = 2
    return solver.solve(cp.cp), solver


def _profile(chain: Chain, timeline: _Timeline, regions: tuple[Region, ...]) -> Option | None:
    """The option of running the middle block with `regions`, every other block unplanned;
    None when the simulator refuses it or what it does to a segment is not one number."""
    rmap = chain.rmap
    try:
        priced = price(rmap, *kept_of(rmap, regions), "option") if regions else timeline.base
    except InvalidSchedule:
        return None
    schedule, curve = priced.lowering.schedule, priced.result.curve
    delta = curve[schedule.node == schedule.stage] - timeline.curve
    peaks, held = {}, {}
    for segment in chain.segments:
        if segment.kind in OWN_PHASES and segment.block == timeline.middle:
            inside = (schedule.stage >= segment.first) & (schedule.stage <= segment.last)
            peaks[segment.kind] = int(curve[inside].max())
            continue
        relation = chain.relation(segment, timeline.middle)
        held[relation] = max(held.get(relation, -math.inf), int(delta[segment.first:segment.last + 1].max()))
    return Option(tuple(priced.lowering.regions), priced.cost - timeline.base.cost, peaks, held)


def _pareto(options: list[Option]) -> list[Option]:
    """The options no other is at least as good as in every respect (first of equals kept)."""
    def numbers(o: Option) -> tuple:
        return (o.extra, *(o.peaks[k] for k in sorted(o.peaks)), *(o.held[k] for k in sorted(o.held)))

    kept: list[Option] = []
    for option in options:
        mine = numbers(option)
        if not any(all(a <= b for a, b in zip(numbers(other), mine)) for other in kept):
            kept = [o for o in kept if not all(a <= b for a, b in zip(mine, numbers(o)))] + [option]
    return kept


def _compose(chain: Chain, timeline: _Timeline, options: list[Option], budget: int, time_limit: float,
             workers: int, seed: int, deterministic: bool, hint: list[Option] | None,
             polish: bool) -> list[Option] | None:
    """One option per block, every segment within `budget`, the cheapest found in
    `time_limit` from the cheaper of `hint` and `_chained`'s choice (or the cheapest option
    every block can take; without `polish` that choice itself, when there is one, which is
    within a few hundredths of a point of the polished one on Llama-7B shapes); None
    when no choice fits. CP-SAT finds the best choice in well under a second on 32
    Llama-7B blocks but does not prove it in 30 s (0.07% from its bound); the plan's proof
    is the knapsack's (`_relaxed`), not this search's. On 80 Llama-70B blocks it finds no
    choice at all in 3 s without a complete hint."""
    relations = set(options[0].held)
    given = hint if hint is not None and all(o in options for o in hint) else None
    choices = [c for c in (given, _chained(chain, timeline, options, budget)) if c is not None]
    hint = (min(choices, key=lambda c: sum(o.extra for o in c)) if choices
            else _uniform(chain, timeline, options, budget))
    if hint is not None and not polish:
        return hint
    cp = cp_model.CpModel()
    blocks = range(len(chain.blocks))
    pick = [[cp.new_bool_var(f"y{k}_{i}") for i in range(len(options))] for k in blocks]
    held = {}
    for k, row in enumerate(pick):
        cp.add_exactly_one(row)
        for relation in relations:
            values = [o.held[relation] for o in options]
            var = held[(k, relation)] = cp.new_int_var(min(values), max(values), "")
            cp.add(var == sum(v * y for v, y in zip(values, row)))
            if hint is not None:
                cp.add_hint(var, hint[k].held[relation])
        for option, y in zip(options, row) if hint is not None else ():
            cp.add_hint(y, option is hint[k])
    for segment in chain.segments:
        others = [held[(k, chain.relation(segment, k))] for k in blocks
                  if not (segment.kind in OWN_PHASES and segment.block == k)]
        if segment.kind in OWN_PHASES:
            own = sum(o.peaks[segment.kind] * y for o, y in zip(options, pick[segment.block]))
            cp.add(own + timeline.shift[(segment.kind, segment.block)] + sum(others) <= budget)
        else:
            cp.add(int(timeline.curve[segment.first:segment.last + 1].max()) + sum(others) <= budget)
    scale = SCALE / max(chain.rmap.graph.total_cost, 1e-12)
    cp.minimize(sum(math.floor(o.extra * scale) * y for k in blocks for o, y in zip(options, pick[k])))
    solver = cp_model.CpSolver()
    configure(solver, time_limit, time.perf_counter(), workers or 8, seed, deterministic)
    if solver.solve(cp) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return hint
    return [next(o for o, y in zip(options, pick[k]) if solver.value(y)) for k in blocks]


BUCKETS = 1 << 16
"""Steps in which `_chained` counts the bytes the blocks before a block hold."""


def _chained(chain: Chain, timeline: _Timeline, options: list[Option], budget: int) -> list[Option] | None:
    """One option per block by dynamic programming along the chain, None when the options
    do not have the shape it needs or nothing fits. A block's segments are charged what
    the blocks before it hold, which it reads off one number, the bytes they hold at the
    head and loss: the others exceed it by at most a constant per block (the largest
    over the options) and are charged that. The count is rounded up to BUCKETS steps, so
    every choice fits, at the price of a little slack; blocks after a segment and the
    gaps before and after the blocks must not be touched by any option."""
    relations = options[0].held
    if any(o.held[r] for o in options for r in relations if r[1] < 0 or r[0] in (BEFORE, END)):
        return None
    blocks = len(chain.blocks)
    anchored = np.array([o.held[(MIDDLE, 0)] for o in options], dtype=np.int64)
    lowest = int(anchored.min())
    step = max(1, -(-int((anchored - lowest).max()) // (BUCKETS // blocks)))
    width = -(-(anchored - lowest) // step)
    offset = {r: max(o.held[r] - o.held[(MIDDLE, 0)] for o in options) for r in relations if r[1] > 0}
    extra = np.array([o.extra for o in options])
    cost = np.full(BUCKETS + 1, np.inf)
    cost[0] = 0.0
    choices = np.zeros((blocks, BUCKETS + 1), dtype=np.int32)
    counted = np.arange(BUCKETS + 1, dtype=np.int64) * step
    segments = {(s.kind, s.block): s for s in chain.segments}
    for k in range(blocks):
        before = k * lowest + counted
        following = np.full(BUCKETS + 1, np.inf)
        for i, option in enumerate(options):
            fits = np.ones(BUCKETS + 1, dtype=bool)
            for kind in OWN_PHASES:
                own = option.peaks[kind] + timeline.shift[(kind, k)]
                fits &= own + before + k * offset.get((kind, 1), 0) <= budget
            for kind in (AFTER_FORWARD, AFTER_BACKWARD):
                gap = segments.get((kind, k))
                if gap is not None:
                    held = int(timeline.curve[gap.first:gap.last + 1].max()) + option.held.get((kind, 0), 0)
                    fits &= held + before + k * offset.get((kind, 1), 0) <= budget
            w = int(width[i])
            candidate = np.where(fits, cost, np.inf)[:BUCKETS + 1 - w] + extra[i]
            better = candidate < following[w:]
            following[w:][better] = candidate[better]
            choices[k, w:][better] = i
        cost = following
    room = budget - int(timeline.curve[segments[(MIDDLE, -1)].first:segments[(MIDDLE, -1)].last + 1].max())
    cost[blocks * lowest + counted > room] = np.inf
    if not np.isfinite(cost).any():
        return None
    state, picked = int(np.argmin(cost)), []
    for k in range(blocks - 1, -1, -1):
        i = int(choices[k, state])
        picked.append(options[i])
        state -= int(width[i])
    picked.reverse()
    return picked if _peak(chain, timeline, picked) <= budget else None


def _uniform(chain: Chain, timeline: _Timeline, options: list[Option], budget: int) -> list[Option] | None:
    """The cheapest option that every block taking it fits `budget`, for every block."""
    for option in sorted(options, key=lambda o: o.extra):
        picked = [option] * len(chain.blocks)
        if _peak(chain, timeline, picked) <= budget:
            return picked
    return None


def _peak(chain: Chain, timeline: _Timeline, picked: list[Option]) -> int:
    """The peak the composition predicts for one option per block."""
    peak = 0
    for segment in chain.segments:
        others = sum(o.held[chain.relation(segment, k)] for k, o in enumerate(picked)
                     if not (segment.kind in OWN_PHASES and segment.block == k))
        if segment.kind in OWN_PHASES:
            own = picked[segment.block].peaks[segment.kind] + timeline.shift[(segment.kind, segment.block)]
        else:
            own = int(timeline.curve[segment.first:segment.last + 1].max())
        peak = max(peak, own + others)
    return peak


def _bound(menus: list[tuple[int, list[tuple[int, float]]]], room: int) -> tuple[float, list[list[int]] | None]:
    """The least extra cost of blocks in groups (how many, the cells they choose from:
    each cell's least bytes and least extra cost) whose bytes sum to at most `room`
    (infinite if none fits, -inf when not solved), and per group the cells the least
    choice takes (None when none is known)."""
    cp = cp_model.CpModel()
    unit = max((extra for _, cells in menus for _, extra in cells), default=0.0) / 1e12 or 1.0
    used, cost, counted = [], [], []
    for count, cells in menus:
        counts = [cp.new_int_var(0, count, "") for _ in cells]
        cp.add(sum(counts) == count)
        used += [lo * n for (lo, _), n in zip(cells, counts)]
        cost += [math.floor(extra / unit) * n for (_, extra), n in zip(cells, counts)]
        counted.append(counts)
    cp.add(sum(used) <= room)
    cp.minimize(sum(cost))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    status = solver.solve(cp)
    if status == cp_model.INFEASIBLE:
        return math.inf, None
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return -math.inf, None
    chosen = [[i for i, n in enumerate(counts) if solver.value(n) > 0] for counts in counted]
    return solver.best_objective_bound * unit, chosen
