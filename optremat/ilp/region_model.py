"""The exact model of module-region plans: which calls of one structure run under
checkpoint and which of their ops a selective policy saves, with every event's memory
written as the simulator counts it on the schedule `regions.lower` builds.

Decisions are booleans: `("x", i)` the structure's i-th call runs under checkpoint,
`("s", o)` its policy saves op o, `("r", o)` the rerun recomputes the storage op o owns
(checkpointed and not saved). A storage instance (the original or the rerun's copy of an
owner's unit) is live at an event when one of its holders is; a holder is live while its
`until` lasts, or to its last reader within the stage its `until` ends in. Each way of
being live is a conjunction of decisions, so an event's bytes are a constant plus, per
instance, its size times the OR of conjunctions: linear once each OR is a variable that
is at least each of its conjunctions (the budget only pushes it down).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from optremat.graph import Graph
from optremat.regions import Call, Region, RegionMap, Rerun

Atom = tuple[str, int]
Literal = tuple[Atom, bool]
Conjunction = tuple[Literal, ...]
TRUE: Conjunction = ()


@dataclass(frozen=True)
class Checkpointable:
    """A call of the structure some plan checkpoints: its position, how it reruns, and
    the ops its policy must save when it is checkpointed."""

    index: int
    call: Call
    rerun: Rerun
    forced: frozenset[int]


@dataclass(frozen=True)
class Row:
    """One event's bytes: `constant` plus, per storage instance whose life depends on the
    decisions, its bytes times the OR of `conjunctions`; the event happens only when
    `when` holds (a rerun's computation)."""

    stage: int
    node: int
    constant: int
    terms: tuple[tuple[int, tuple[Conjunction, ...]], ...]
    when: Literal | None


def holds(conjunction: Conjunction, values: Mapping[Atom, bool]) -> bool:
    """Whether every literal of `conjunction` holds under `values`."""
    return all(values[atom] == positive for atom, positive in conjunction)


class RegionModel:
    """The events of every plan of `structure` as rows over the decisions (see module)."""

    def __init__(self, rmap: RegionMap, structure: Sequence[Call]) -> None:
        self.rmap = rmap
        self.graph = graph = rmap.graph
        self.structure = tuple(structure)
        self.owner = rmap.facts.owner
        self.calls = [c for i, call in enumerate(self.structure) if (c := _checkpointable(rmap, i, call)) is not None]
        self.recomputed_in = {v: c for c in self.calls for v in c.rerun.recomputable}
        self.rerun_at = {c.rerun.t: c for c in self.calls}
        self.saveable = {c.index: sorted(c.forced | ({int(self.owner[v]) for v in c.rerun.recomputable}
                                                    & c.rerun.saveable)) for c in self.calls}
        self._terms = _until_terms(self)
        self._instances = _instances(graph, self.owner, self.recomputed_in)
        self._late_view = _late_views(graph, self.recomputed_in)
        self._copy_until = {v: max([c.rerun.t] + [s for s in graph.succs[v].tolist()
                                                  if graph.backward[s] and s >= c.rerun.t])
                            for v, c in self.recomputed_in.items()}

    def r(self, v: int) -> Literal:
        """The literal that node v (recomputable) is recomputed."""
        return ("r", int(self.owner[v])), True

    def values(self, checkpointed: Iterable[int], saved: Iterable[int]) -> dict[Atom, bool]:
        """Every atom's value for a plan: the calls (structure indices) checkpointed and the
        ops their policies save (forced saves added)."""
        on, kept = set(checkpointed), set(saved)
        values: dict[Atom, bool] = {}
        for c in self.calls:
            x = values[("x", c.index)] = c.index in on
            for o in self.saveable[c.index]:
                values[("s", o)] = x and (o in kept or o in c.forced)
            for v in c.rerun.recomputable:
                o = int(self.owner[v])
                values[("r", o)] = x and not values.get(("s", o), False)
        return values

    def values_of(self, regions: Iterable[Region]) -> dict[Atom, bool]:
        """The decisions of the plan checkpointing `regions` (those of other structures ignored)."""
        index = {c.call: c for c in self.calls}
        on, saved = [], []
        for region in regions:
            c = index.get((region.path, region.call))
            if c is not None:
                on.append(c.index)
                saved += [v for v, key in self.rmap.keys(c.call).items() if key in region.saved]
        return self.values(on, saved)

    def read_back(self, c: Checkpointable) -> list[int]:
        """Owners whose recomputation the backward reads: a checkpointed call recomputes at
        least one, else it runs plainly (`regions._region`)."""
        reads = self.rmap.facts.backward_reads
        return sorted({int(self.owner[v]) for v in c.rerun.recomputable if reads[v]} - c.forced)

    def realisable(self, values: Mapping[Atom, bool]) -> bool:
        """Whether every call `values` checkpoints recomputes something the backward reads."""
        return all(not values[("x", c.index)] or any(values[("r", o)] for o in self.read_back(c)) for c in self.calls)

    def kept(self, values: Mapping[Atom, bool]) -> np.ndarray:
        """The keep set `regions.lower` realises as the plan `values` describes."""
        kept = np.ones(self.graph.n, dtype=bool)
        for c in self.calls:
            if values[("x", c.index)]:
                kept[list(c.rerun.nodes)] = False
                for o in self.saveable[c.index]:
                    kept[o] = values[("s", o)]
        return kept

    def row(self, stage: int, node: int) -> Row:
        """The bytes of the event computing `node` in `stage` (a rerun's when node < stage)."""
        graph = self.graph
        constant = int(graph.held[stage]) + int(graph.workspace[node])
        terms = []
        for o, copy, size, holders in self._instances:
            ways = [w for h in holders for w in self._holder_live(o, copy, h, stage, node) if _consistent(w)]
            if not ways:
                continue
            if TRUE in ways:
                constant += size
            else:
                terms.append((size, tuple(dict.fromkeys(ways))))
        return Row(stage, node, constant, tuple(terms), self.r(node) if node != stage else None)

    def evaluate(self, row: Row, values: Mapping[Atom, bool]) -> int | None:
        """The row's bytes under `values`, None when its event does not happen."""
        if row.when is not None and not holds((row.when,), values):
            return None
        return row.constant + sum(size for size, ways in row.terms if any(holds(w, values) for w in ways))

    def _holder_live(self, o: int, copy: bool, h: int, stage: int, node: int) -> list[Conjunction]:
        """Ways holder h keeps the instance (o's original or its rerun's copy) live at the
        event (`_late_view`: which one a backward view holds depends on the rerun)."""
        late_view = self._late_view.get(h, False)
        if copy:
            if h in self._copy_until:
                return self._copy_live(h, stage, node)
            return [w + (self.r(o),) for w in self._original_live(h, stage, node)] if late_view else []
        if late_view:
            return [w + (_not(self.r(o)),) for w in self._original_live(h, stage, node)]
        return self._original_live(h, stage, node)

    def _readers_after(self, h: int, stage: int, node: int) -> list[Conjunction]:
        """Ways `h` is read by an event of `stage` at or after the one computing `node`."""
        graph = self.graph
        ways = [TRUE] if h in graph.preds[stage].tolist() else []
        rerun = self.rerun_at.get(stage)
        if rerun is not None:
            ways += [(self.r(w),) for w in rerun.rerun.recomputable if w >= node and h in graph.preds[w].tolist()]
        return ways

    def _original_live(self, h: int, stage: int, node: int) -> list[Conjunction]:
        """Ways the forward's computation of h is live at the event: made by then, and its
        `until` past the stage, or ending in it with a reader still to come."""
        if h > stage or (h == stage and node != stage):
            return []
        if h == stage:
            return [TRUE]
        ways = [w for end, w in self._terms[h] if end > stage]
        ways += [w + r for end, w in self._terms[h] if end == stage for r in self._readers_after(h, stage, node)]
        return ways

    def _copy_live(self, v: int, stage: int, node: int) -> list[Conjunction]:
        """Ways the rerun's copy of v is live at the event (as `_original_live`)."""
        t = self.recomputed_in[v].rerun.t
        if t > stage or (t == stage and v > node):
            return []
        until, made = self._copy_until[v], (self.r(v),)
        if until > stage or (t == stage and v == node):
            return [made]
        if until < stage:
            return []
        return [made + r for r in self._readers_after(v, stage, node)]


def _not(literal: Literal) -> Literal:
    return literal[0], not literal[1]


def _consistent(conjunction: Conjunction) -> bool:
    """Whether no atom appears in `conjunction` both plain and negated."""
    seen: dict[Atom, bool] = {}
    for atom, positive in conjunction:
        if seen.setdefault(atom, positive) != positive:
            return False
    return True


def _until_terms(model: RegionModel) -> list[list[tuple[int, Conjunction]]]:
    """Per node, the stages its original lives until, each under the conjunction that
    makes it so (its `until` is the latest that holds), as `regions._schedule` sets them."""
    graph, n = model.graph, model.graph.n
    terms: list[dict[Conjunction, int]] = [{} for _ in range(n)]

    def add(h: int, end: int, way: Conjunction) -> None:
        terms[h][way] = max(terms[h].get(way, -1), end)

    for h in range(n):
        succs = graph.succs[h].tolist()
        rerun = model.recomputed_in.get(h)
        if graph.pinned[h] or graph.output[h]:
            add(h, n, TRUE)
        elif rerun is None:
            add(h, max([h] + succs), TRUE)
        else:
            add(h, max([h] + [s for s in succs if not (graph.backward[s] and s >= rerun.rerun.t)]), TRUE)
            add(h, max([h] + succs), (_not(model.r(h)),))
    for c in model.calls:
        inside = set(c.rerun.recomputable)
        for w in c.rerun.recomputable:
            for p in graph.preds[w].tolist():
                if p not in inside:
                    add(p, c.rerun.t, (model.r(w),))
                elif model.owner[p] != model.owner[w]:
                    add(p, c.rerun.t, (model.r(w), _not(model.r(p))))
        for p in c.rerun.external:
            add(p, c.rerun.released, ((("x", c.index), True),))
        for o in model.saveable[c.index]:
            add(o, min(c.rerun.t + 1, n - 1), ((("s", o), True),))
    return [[(end, way) for way, end in found.items() if way == TRUE or end > found.get(TRUE, -1)]
            for found in terms]


def _late_views(graph: Graph, recomputed_in: Mapping[int, Checkpointable]) -> dict[int, bool]:
    """Backward views that hold a rerun's copy when it is made: a view holds what its base
    holds when the view is made, so a backward view (or a view of it) whose forward base
    is recomputable, made at or after that base's rerun."""
    late: dict[int, bool] = {}
    for h in np.nonzero(graph.backward & (graph.alias_of >= 0))[0].tolist():
        base = int(graph.alias_of[h])
        if graph.backward[base]:
            late[h] = late.get(base, False)
        else:
            rerun = recomputed_in.get(base)
            late[h] = rerun is not None and h >= rerun.rerun.t
    return late


def _instances(graph: Graph, owner: np.ndarray, recomputed_in: Mapping[int, Checkpointable]
               ) -> list[tuple[int, bool, int, tuple[int, ...]]]:
    """Every storage instance some plan makes: (owner, whether the rerun's copy, bytes,
    the nodes holding it). An owner's units are separate instances; a part or a view of
    a part holds one unit, the owner and its plain views all of them."""
    holders: dict[tuple[int, int], list[int]] = {}
    for i, units in enumerate(graph.units):
        for u in units:
            holders.setdefault((int(owner[i]), u), []).append(i)
    found = []
    for (o, u), nodes in holders.items():
        size = int(graph.unit_size[u])
        if size == 0:
            continue
        found.append((o, False, size, tuple(nodes)))
        if o in recomputed_in:
            found.append((o, True, size, tuple(nodes)))
    return found


def _checkpointable(rmap: RegionMap, index: int, call: Call) -> Checkpointable | None:
    """The call, if some plan checkpoints it: one that can be, where every output read
    after it can be saved and some tensor the backward reads can be recomputed."""
    rerun, owner, reads = rmap.rerun(call), rmap.facts.owner, rmap.facts.backward_reads
    if rerun is None:
        return None
    recomputable = set(rerun.recomputable)
    if any(v in recomputable and int(owner[v]) not in rerun.saveable for v in rerun.read_after):
        return None
    forced = frozenset(int(owner[v]) for v in rerun.read_after) & rerun.saveable
    if not any(reads[v] and int(owner[v]) not in forced for v in rerun.recomputable):
        return None
    return Checkpointable(index, call, rerun, forced)
