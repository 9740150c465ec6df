"""The exact model of module-region plans: which candidate calls run under checkpoint
(any set of them no two of which share an op: a block, a sub-module of another block, a
run of a Sequential's children) and which of their ops a selective policy saves, with
every event's memory written as the simulator counts it on the schedule `regions.lower`
builds.

Decisions are booleans: `("x", i, -1)` the i-th candidate runs under checkpoint,
`("s", o, i)` its policy saves op o, `("r", o, i)` its rerun recomputes the storage op o
owns (checkpointed and not saved). A storage instance (the original, or a rerun's copy of
an owner's unit) is live at an event when one of its holders is; a holder is live while
its `until` lasts, or to its last reader within the stage its `until` ends in. Each way
of being live is a conjunction of decisions, so an event's bytes are a constant plus, per
instance, its size times the OR of conjunctions: linear once each OR is a variable that
is at least each of its conjunctions (the budget only pushes it down).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from optremat.core.graph import Graph
from optremat.planners.regions import Call, Region, RegionMap, Rerun

Atom = tuple[str, int, int]
Literal = tuple[Atom, bool]
Conjunction = tuple[Literal, ...]
TRUE: Conjunction = ()
OWN = -1
"""The call of an event that is its stage's own computation, not a rerun's."""


@dataclass(frozen=True)
class Checkpointable:
    """A candidate call some plan checkpoints: its position, how it reruns, and the ops
    its policy must save when it is checkpointed."""

    index: int
    call: Call
    rerun: Rerun
    forced: frozenset[int]


@dataclass(frozen=True)
class Row:
    """One event's bytes: `constant` plus, per storage instance whose life depends on the
    decisions, its bytes times the OR of `conjunctions`; the event happens only when
    `when` holds (a rerun's computation, of candidate `call`)."""

    stage: int
    node: int
    call: int
    constant: int
    terms: tuple[tuple[int, tuple[Conjunction, ...]], ...]
    when: Literal | None


def holds(conjunction: Conjunction, values: Mapping[Atom, bool]) -> bool:
    """Whether every literal of `conjunction` holds under `values`."""
    return all(values[atom] == positive for atom, positive in conjunction)


class RegionModel:
    """The events of every plan over `candidates` as rows over the decisions (see module)."""

    def __init__(self, rmap: RegionMap, candidates: Sequence[Call]) -> None:
        self.rmap = rmap
        self.graph = graph = rmap.graph
        self.structure = tuple(candidates)
        self.owner = rmap.facts.owner
        self.calls = [c for i, call in enumerate(self.structure) if (c := _checkpointable(rmap, i, call)) is not None]
        self._by_index = {c.index: c for c in self.calls}
        self.recomputed_in: dict[int, list[Checkpointable]] = {}
        self.rerun_at: dict[int, list[Checkpointable]] = {}
        for c in self.calls:
            self.rerun_at.setdefault(c.rerun.t, []).append(c)
            for v in c.rerun.recomputable:
                self.recomputed_in.setdefault(v, []).append(c)
        self.saveable = {c.index: sorted(c.forced | ({int(self.owner[v]) for v in c.rerun.recomputable}
                                                    & c.rerun.saveable)) for c in self.calls}
        self.shared = _shared(rmap, self.calls)
        self._terms = _until_terms(self)
        self._instances = _instances(graph, self.owner, self.recomputed_in)
        self._late_view = _late_views(graph, self.recomputed_in)
        self._copy_until = {(v, c.index): max([c.rerun.t] + [s for s in graph.succs[v].tolist()
                                                             if graph.backward[s] and s >= c.rerun.t])
                            for v, calls in self.recomputed_in.items() for c in calls}
        self.stash = {c.index: rmap.stash(c.call) for c in self.calls}

    def x(self, i: int) -> Literal:
        """The literal that candidate i runs under checkpoint."""
        return ("x", i, OWN), True

    def s(self, o: int, i: int) -> Literal:
        """The literal that candidate i's policy saves op o."""
        return ("s", o, i), True

    def r(self, v: int, i: int) -> Literal:
        """The literal that candidate i's rerun recomputes node v."""
        return ("r", int(self.owner[v]), i), True

    def values(self, checkpointed: Iterable[int], saved: Iterable[int]) -> dict[Atom, bool]:
        """Every atom's value for a plan: the candidates (indices) checkpointed and the
        ops their policies save (forced saves added)."""
        on, kept = set(checkpointed), set(saved)
        values: dict[Atom, bool] = {}
        for c in self.calls:
            x = values[self.x(c.index)[0]] = c.index in on
            for o in self.saveable[c.index]:
                values[self.s(o, c.index)[0]] = x and (o in kept or o in c.forced)
            for v in c.rerun.recomputable:
                saved_too = values.get(self.s(int(self.owner[v]), c.index)[0], False)
                values[self.r(v, c.index)[0]] = x and not saved_too
        return values

    def values_of(self, regions: Iterable[Region]) -> dict[Atom, bool]:
        """The decisions of the plan checkpointing `regions` (those not among the
        candidates ignored)."""
        index = {c.call: c for c in self.calls}
        on, saved = [], []
        for region in regions:
            c = index.get((region.path, region.call))
            if c is not None:
                on.append(c.index)
                saved += [v for v, key in self.rmap.keys(c.call).items() if key in region.saved]
        return self.values(on, saved)

    def read_back(self, c: Checkpointable) -> list[int]:
        """Owners up to the rerun's stop whose recomputation the backward reads: a
        checkpointed call recomputes at least one, else it runs plainly (`regions._region`)."""
        reads = self.rmap.facts.backward_reads
        recomputed = [v for v in c.rerun.recomputable if v <= c.rerun.stop]
        return sorted({int(self.owner[v]) for v in recomputed if reads[v]} - c.forced)

    def realisable(self, values: Mapping[Atom, bool]) -> bool:
        """Whether no two calls `values` checkpoints share an op, and each recomputes
        something the backward reads."""
        on = {c.index for c in self.calls if values[self.x(c.index)[0]]}
        return (all(len(on & group) <= 1 for group in self.shared)
                and all(any(values[self.r(o, c.index)[0]] for o in self.read_back(c))
                        for c in self.calls if c.index in on))

    def regions(self, values: Mapping[Atom, bool]) -> tuple[Region, ...]:
        """The regions the plan `values` describes: each checkpointed call, keyed with the
        ops its policy saves."""
        return tuple(Region(c.call[0], c.call[1], frozenset(self.rmap.keys(c.call)[o] for o in self.saveable[c.index]
                                                            if values[self.s(o, c.index)[0]]))
                     for c in self.calls if values[self.x(c.index)[0]])

    def chosen(self, values: Mapping[Atom, bool]) -> tuple[Call, ...]:
        """The calls the plan `values` describes checkpoints, in candidate order."""
        return tuple(c.call for c in self.calls if values[self.x(c.index)[0]])

    def kept(self, values: Mapping[Atom, bool]) -> np.ndarray:
        """The keep set `regions.lower` realises, over `chosen`, as the plan `values` describes."""
        kept = np.ones(self.graph.n, dtype=bool)
        for c in self.calls:
            if values[self.x(c.index)[0]]:
                kept[list(c.rerun.nodes)] = False
                for o in self.saveable[c.index]:
                    kept[o] = values[self.s(o, c.index)[0]]
        return kept

    def call_of(self, stage: int, node: int, values: Mapping[Atom, bool]) -> int:
        """The candidate whose rerun computes `node` in `stage` under `values` (OWN for the
        stage's own computation)."""
        if node == stage:
            return OWN
        return next(c.index for c in self.rerun_at[stage] if values[self.x(c.index)[0]])

    def row(self, stage: int, node: int, call: int) -> Row:
        """The bytes of the event computing `node` in `stage` (candidate `call`'s rerun, or
        the stage's own computation when `call` is OWN), with what the runtime holds for
        the checkpointed calls (`RegionMap.stash`)."""
        graph = self.graph
        constant = int(graph.held[stage]) + int(graph.workspace[node])
        constant += 0 if call == OWN else self.stash[call].rerun_bytes
        terms = [(nbytes, ((self.x(c.index),),)) for c in self.calls
                 for first, last, nbytes in self.stash[c.index].spans if first <= stage <= last]
        for o, copy, size, holders in self._instances:
            ways = [w for h in holders for w in self._holder_live(o, copy, h, stage, node) if _consistent(w)]
            if not ways:
                continue
            if TRUE in ways:
                constant += size
            else:
                terms.append((size, tuple(dict.fromkeys(ways))))
        return Row(stage, node, call, constant, tuple(terms), None if call == OWN else self.r(node, call))

    def evaluate(self, row: Row, values: Mapping[Atom, bool]) -> int | None:
        """The row's bytes under `values`, None when its event does not happen."""
        if row.when is not None and not holds((row.when,), values):
            return None
        return row.constant + sum(size for size, ways in row.terms if any(holds(w, values) for w in ways))

    def _holder_live(self, o: int, copy: int | None, h: int, stage: int, node: int) -> list[Conjunction]:
        """Ways holder h keeps the instance (o's original, or candidate `copy`'s rerun copy)
        live at the event. A backward view holds what its base held when the view was made:
        the copy of a rerun before it that recomputes its base, else the original."""
        late = self._late_view.get(h, ())
        if copy is not None:
            if (h, copy) in self._copy_until:
                return self._copy_live(h, copy, stage, node)
            return [w + (self.r(o, copy),) for w in self._original_live(h, stage, node)] if copy in late else []
        unless = tuple(_not(self.r(o, i)) for i in late)
        return [w + unless for w in self._original_live(h, stage, node)]

    def _readers_after(self, h: int, stage: int, node: int) -> list[Conjunction]:
        """Ways `h` is read by an event of `stage` at or after the one computing `node`."""
        graph = self.graph
        ways = [TRUE] if h in graph.preds[stage].tolist() else []
        for c in self.rerun_at.get(stage, ()):
            ways += [(self.r(w, c.index),) for w in c.rerun.recomputable
                     if w >= node and h in graph.preds[w].tolist()]
        return ways

    def _held_to(self, stage: int, node: int, through: int) -> list[Conjunction]:
        """Ways an event of `stage` at or after the one computing `node` computes a node up
        to `through` (`Schedule.through` keeps a value alive through it)."""
        return [(self.r(w, c.index),) for c in self.rerun_at.get(stage, ()) for w in c.rerun.recomputable
                if node <= w <= through]

    def _original_live(self, h: int, stage: int, node: int) -> list[Conjunction]:
        """Ways the forward's computation of h is live at the event: made by then, and its
        `until` past the stage, or ending in it with a reader still to come (or, for an
        op a policy saved, its call's rerun still under way)."""
        if h > stage or (h == stage and node != stage):
            return []
        if h == stage:
            return [TRUE]
        ways = [w for end, w in self._terms[h] if end > stage]
        for end, w in self._terms[h]:
            if end == stage:
                ways += [w + r for r in self._readers_after(h, stage, node) + self._saved_until(w, stage, node)]
        return ways

    def _saved_until(self, way: Conjunction, stage: int, node: int) -> list[Conjunction]:
        """Ways the selective policy's storage still holds an op `way` saves (a saving
        literal) at the event: its call reruns in `stage` and its rerun is not over."""
        if len(way) != 1 or way[0][0][0] != "s":
            return []
        c = self._by_index[way[0][0][2]]
        return self._held_to(stage, node, max(c.rerun.recomputable)) if c.rerun.t == stage else []

    def _copy_live(self, v: int, i: int, stage: int, node: int) -> list[Conjunction]:
        """Ways candidate i's rerun copy of v is live at the event (as `_original_live`)."""
        t = self._by_index[i].rerun.t
        if t > stage or (t == stage and v > node):
            return []
        until, made = self._copy_until[(v, i)], (self.r(v, i),)
        if until > stage or (t == stage and v == node):
            return [made]
        if until < stage:
            return []
        held = self._held_to(stage, node, int(self.graph.lives_to[v])) if until == t else []
        return [made + r for r in self._readers_after(v, stage, node) + held]


def _not(literal: Literal) -> Literal:
    return literal[0], not literal[1]


def _consistent(conjunction: Conjunction) -> bool:
    """Whether no atom appears in `conjunction` both plain and negated."""
    seen: dict[Atom, bool] = {}
    for atom, positive in conjunction:
        if seen.setdefault(atom, positive) != positive:
            return False
    return True


def _shared(rmap: RegionMap, calls: list[Checkpointable]) -> list[set[int]]:
    """Groups of candidates sharing an op (at most one of each is checkpointed)."""
    covering: dict[int, set[int]] = {}
    for c in calls:
        for v in c.rerun.nodes:
            covering.setdefault(v, set()).add(c.index)
    groups = {frozenset(group) for group in covering.values() if len(group) > 1}
    return [set(group) for group in groups if not any(group < other for other in groups)]


def _until_terms(model: RegionModel) -> list[list[tuple[int, Conjunction]]]:
    """Per node, the stages its original lives until, each under the conjunction that
    makes it so (its `until` is the latest that holds), as `regions._schedule` sets them."""
    graph, n = model.graph, model.graph.n
    terms: list[dict[Conjunction, int]] = [{} for _ in range(n)]

    def add(h: int, end: int, way: Conjunction) -> None:
        terms[h][way] = max(terms[h].get(way, -1), end)

    for h in range(n):
        succs = graph.succs[h].tolist()
        reruns = model.recomputed_in.get(h, [])
        if graph.pinned[h] or graph.output[h]:
            add(h, n, TRUE)
            continue
        held = int(graph.held_until[h])
        add(h, max([held] + succs), tuple(_not(model.r(h, c.index)) for c in reruns))
        for c in reruns:
            add(h, max([held] + [s for s in succs if not (graph.backward[s] and s >= c.rerun.t)]),
                (model.r(h, c.index),))
    for c in model.calls:
        inside = set(c.rerun.recomputable)
        for w in c.rerun.recomputable:
            for p in graph.preds[w].tolist():
                if p not in inside:
                    add(p, c.rerun.t, (model.r(w, c.index),))
                elif model.owner[p] != model.owner[w]:
                    add(p, c.rerun.t, (model.r(w, c.index), _not(model.r(p, c.index))))
        for p in c.rerun.external:
            add(p, c.rerun.released, (model.x(c.index),))
        for o in model.saveable[c.index]:
            add(o, c.rerun.t, (model.s(o, c.index),))
    return [[(end, way) for way, end in found.items() if way == TRUE or end > found.get(TRUE, -1)]
            for found in terms]


def _late_views(graph: Graph, recomputed_in: Mapping[int, list[Checkpointable]]) -> dict[int, tuple[int, ...]]:
    """Per backward view, the candidates whose rerun copy it holds when that rerun
    recomputes its forward base: those that can, run at or before the view is made."""
    late: dict[int, tuple[int, ...]] = {}
    for h in np.nonzero(graph.backward & (graph.alias_of >= 0))[0].tolist():
        base = int(graph.alias_of[h])
        if graph.backward[base]:
            late[h] = late.get(base, ())
        else:
            late[h] = tuple(c.index for c in recomputed_in.get(base, ()) if h >= c.rerun.t)
    return late


def _instances(graph: Graph, owner: np.ndarray, recomputed_in: Mapping[int, list[Checkpointable]]
               ) -> list[tuple[int, int | None, int, tuple[int, ...]]]:
    """Every storage instance some plan makes: (owner, the candidate whose rerun copy it
    is or None for the original, bytes, the nodes holding it). An owner's units are
    separate instances; a part or a view of a part holds one unit, the owner and its
    plain views all of them."""
    holders: dict[tuple[int, int], list[int]] = {}
    for i, units in enumerate(graph.units):
        for u in units:
            holders.setdefault((int(owner[i]), u), []).append(i)
    found = []
    for (o, u), nodes in holders.items():
        size = int(graph.unit_size[u])
        if size == 0:
            continue
        found.append((o, None, size, tuple(nodes)))
        found += [(o, c.index, size, tuple(nodes)) for c in recomputed_in.get(o, ())]
    return found


def _checkpointable(rmap: RegionMap, index: int, call: Call) -> Checkpointable | None:
    """The call, if some plan checkpoints it: one that can be, where every output read
    after it can be saved and some tensor the backward reads can be recomputed."""
    rerun, owner, reads = rmap.reruns.get(call), rmap.facts.owner, rmap.facts.backward_reads
    if rerun is None:
        return None
    recomputable = set(rerun.recomputable)
    if any(v in recomputable and int(owner[v]) not in rerun.saveable for v in rerun.read_after):
        return None
    forced = frozenset(int(owner[v]) for v in rerun.read_after) & rerun.saveable
    if not any(reads[v] and int(owner[v]) not in forced for v in rerun.recomputable if v <= rerun.stop):
        return None
    return Checkpointable(index, call, rerun, forced)
