"""Schedules (the universal plan format) and the simulator that prices them.

A schedule runs in stages over the graph's topological order: stage t computes node t,
preceded by any recomputations placed there. It is stored as computation events
`(node, stage, until)`: the node is computed in `stage` and its output is kept alive
through stage `until` (Checkmate's R matrix is the set of (stage, node) pairs, its S
matrix the stages strictly after `stage` up to `until`).

Memory model (the one every number in optremat comes from): within a stage, nodes run in
index order; computing a node allocates its storage while its inputs are still live,
which is the moment a peak can occur; right after, every tensor whose last use in the
stage this was, and which is not kept into the next stage, is freed. A tensor kept into a
stage it is not used in is freed at the start of that stage. Nodes hold storage units
(`Graph.units`): an alias holds its base's, one output of a multi-output op holds its
own part. Each computation of a node that owns storage allocates fresh units; a unit
counts once however many live nodes hold it, so a base recomputed while an alias still
holds its old storage costs twice. Parameters and inputs are resident from the start;
outputs (loss, gradients) are never freed: they are the step's result. Bytes the runtime
holds outside the graph's tensors during a stage (`Graph.held`) count at every
computation of that stage; bytes the runtime running one schedule holds beside them
(`Schedule.held`, per computation: checkpoint's stashed RNG states, say) count at theirs.
A computation whose `Schedule.through` names a node stays alive, in the stage its
`until` ends in, through the last computation there of a node up to that one, as if
that computation read it (what Python holds within a rerun, say).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable

import numpy as np

from optremat.core.graph import Graph

FORMAT_VERSION = 1


class InvalidSchedule(ValueError):
    """A schedule that cannot run: names the first offending stage and node."""

    def __init__(self, message: str, stage: int, node: int) -> None:
        super().__init__(f"stage {stage}, node {node}: {message}")
        self.stage = stage
        self.node = node


@dataclass(frozen=True, eq=False)
class Schedule:
    """Computation events sorted by (stage, node); see the module docstring. Per event,
    `held` gives the bytes the runtime running the schedule holds beside the graph's
    tensors as that computation runs (zeros unless given), and `through` the last node
    whose computation in the stage `until` ends in keeps this one alive (-1: none)."""

    node: np.ndarray
    stage: np.ndarray
    until: np.ndarray
    num_stages: int
    held: np.ndarray = field(default=None)
    through: np.ndarray = field(default=None)

    def __post_init__(self) -> None:
        for name, fill in (("held", 0), ("through", -1)):
            if getattr(self, name) is None:
                column = np.full(len(self.node), fill, dtype=np.int64)
                column.setflags(write=False)
                object.__setattr__(self, name, column)

    @classmethod
    def from_events(cls, events: Iterable[tuple[int, int, int]], num_stages: int) -> "Schedule":
        rows = sorted((int(s), int(i), int(u)) for i, s, u in events)
        array = np.array(rows, dtype=np.int64).reshape(-1, 3)
        columns = []
        for k in (1, 0, 2):
            column = np.ascontiguousarray(array[:, k])
            column.setflags(write=False)
            columns.append(column)
        return cls(node=columns[0], stage=columns[1], until=columns[2], num_stages=int(num_stages))

    def running(self, held: Iterable[int], through: Iterable[int]) -> "Schedule":
        """This schedule as a runtime runs it: `held` bytes and `through` nodes (see the
        class), one entry each per event in event order."""
        columns = [np.array(list(values), dtype=np.int64) for values in (held, through)]
        if any(c.shape != self.node.shape for c in columns) or np.any(columns[0] < 0) or np.any(columns[1] < -1):
            raise ValueError(f"held bytes (>= 0) and through nodes (>= -1) need {len(self.node)} values, one per event")
        for column in columns:
            column.setflags(write=False)
        return Schedule(self.node, self.stage, self.until, self.num_stages, *columns)

    @property
    def events(self) -> list[tuple[int, int, int]]:
        """(node, stage, until) triples in execution order."""
        return list(zip(self.node.tolist(), self.stage.tolist(), self.until.tolist()))

    @cached_property
    def event_index(self) -> dict[tuple[int, int], int]:
        """The index of each computation event, by (node, stage)."""
        return {(int(i), int(s)): e for e, (i, s) in enumerate(zip(self.node, self.stage))}

    @cached_property
    def recomputations(self) -> int:
        """Computation events beyond the first of each node."""
        return len(self.node) - len(np.unique(self.node))

    def to_json(self) -> dict[str, Any]:
        """The schedule as JSON data; `held` and `through` only where its runtime sets them."""
        data = {
            "format": "optremat.schedule",
            "version": FORMAT_VERSION,
            "num_stages": self.num_stages,
            "events": [list(e) for e in self.events],
        }
        if self.held.any() or (self.through >= 0).any():
            data.update(held=self.held.tolist(), through=self.through.tolist())
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Schedule":
        if data.get("format") != "optremat.schedule" or data.get("version") != FORMAT_VERSION:
            raise ValueError(f"not an optremat schedule of format version {FORMAT_VERSION}")
        schedule = cls.from_events(map(tuple, data["events"]), data["num_stages"])
        return schedule.running(data["held"], data["through"]) if "held" in data else schedule


def keep_all(graph: Graph) -> Schedule:
    """The unplanned step: every node computed once, kept until its last consumer ran and
    for as long as the eager step holds it (`Graph.held_until`)."""
    kept = from_kept(graph, np.ones(graph.n, dtype=bool))
    until = np.maximum(kept.until, graph.held_until[kept.node])
    return Schedule.from_events(zip(kept.node.tolist(), kept.stage.tolist(), until.tolist()), graph.n)


def recompute_all(graph: Graph) -> Schedule:
    """Keep only params, inputs and outputs; every stage recomputes what it needs.

    The most memory-frugal schedule of its family at the highest cost (quadratic in
    depth): a reference point for tests and for the smallest-budget search.
    """
    return from_kept(graph, np.zeros(graph.n, dtype=bool))


def from_kept(graph: Graph, kept: np.ndarray, *, reuse: bool = False) -> Schedule:
    """The schedule that keeps the nodes in `kept` and recomputes the rest where needed.

    Each node runs in its own stage; a kept node lives until its last consumer. Without
    `reuse` any other node lives only within a stage and every stage first recomputes
    the unkept ancestors its node needs (Checkmate's checkpoint-set schedule). With
    `reuse` (what `torch.utils.checkpoint` does) an unkept forward tensor lives through
    its forward consumers, is recomputed when a backward node first needs it, and that
    copy serves every later read. Params, inputs and outputs are always kept.
    """
    kept = np.asarray(kept, dtype=bool) | graph.pinned | graph.output
    if reuse:
        available = kept | graph.backward
        computations = []
        for t in np.nonzero(graph.backward)[0].tolist():
            needed = graph.ancestors([t], ~available)[:-1]
            computations += [(i, t) for i in needed]
            available[needed] = True
        return from_computations(graph, computations)
    unkept = ~kept
    runs = [graph.ancestors([t], unkept) for t in range(graph.n)]
    last = np.arange(graph.n)
    for t, nodes in enumerate(runs):
        for k in nodes:
            for p in graph.preds[k].tolist():
                last[p] = max(last[p], t)
    last[graph.pinned | graph.output] = graph.n - 1
    events = [(i, t, int(last[i]) if kept[i] else t) for t, nodes in enumerate(runs) for i in nodes]
    return Schedule.from_events(events, graph.n)


def from_computations(graph: Graph, computations: Iterable[tuple[int, int]]) -> Schedule:
    """The schedule that computes node i in stage s for each (i, s) given, every node also
    in its own stage, keeping each computed tensor only until the last read it serves
    (the latest computation of a node at or before a read serves it)."""
    n = graph.n
    stages: list[set[int]] = [{i} for i in range(n)]
    for i, s in computations:
        stages[int(i)].add(int(s))
    copies = [sorted(s) for s in stages]
    until = {(i, s): s for i in range(n) for s in copies[i]}
    for k in range(n):
        for p in graph.preds[k].tolist():
            for s in copies[k]:
                serving = copies[p][bisect_right(copies[p], s) - 1]
                if until[p, serving] < s:
                    until[p, serving] = s
    resident = graph.pinned | graph.output
    return Schedule.from_events([(i, s, n - 1 if resident[i] else u) for (i, s), u in until.items()], n)


def without_recomputing(graph: Graph, schedule: Schedule, nodes: np.ndarray) -> Schedule:
    """`schedule` with every recomputation of `nodes` (a mask) dropped: each of them is
    computed once, in its own stage, and kept for the reads the dropped copies served;
    every tensor lives until the last read it serves."""
    return from_computations(graph, [(i, s) for i, s, _ in schedule.events if s != i and not nodes[i]])


def without_unread(graph: Graph, schedule: Schedule) -> Schedule:
    """`schedule` without the recomputations whose result no computation reads (the
    latest computation of a node at or before a read serves it), as a compiled graph's
    dead-code elimination drops them: a multi-output op rerun when none of its outputs
    is, and then what only it read. Each tensor lives until the last read it serves."""
    computations = {(i, s) for i, s, _ in schedule.events if s != i}
    while True:
        copies = [[i] for i in range(graph.n)]
        for i, s in computations:
            copies[i].append(s)
        for c in copies:
            c.sort()
        read = {(p, copies[p][bisect_right(copies[p], s) - 1])
                for k in range(graph.n) for s in copies[k] for p in graph.preds[k].tolist()}
        unread = {c for c in computations if c not in read}
        if not unread:
            return from_computations(graph, computations)
        computations -= unread


def read_through(graph: Graph, nodes: np.ndarray) -> Graph:
    """`graph` as run by a compiler that computes each node of `nodes` (a mask; one output
    of a multi-output op only with its op) inside the kernels that read it: such a node,
    and any alias of it, holds no storage, and its readers read its inputs too (through
    chains of such nodes), so those inputs live until the readers run. Price a schedule
    of `graph` on it after `without_recomputing`, which sets each tensor's life anew."""
    inline = np.asarray(nodes, dtype=bool) & ~graph.is_part
    for v in np.nonzero(graph.alias_of >= 0)[0].tolist():
        inline[v] |= bool(inline[graph.alias_of[v]])
    sources: list[frozenset[int]] = []
    for v in range(graph.n):
        sources.append(frozenset().union(*(sources[p] if inline[p] else {p} for p in graph.preds[v].tolist())))
    edges = {(p, v) for v in range(graph.n) for p in sources[v]} | set(map(tuple, graph.edges.tolist()))
    return Graph.build(names=graph.names, ops=graph.ops, cost=graph.cost, size=np.where(inline, 0, graph.size),
                       edges=edges, backward=graph.backward, kind=graph.kind, module=graph.module,
                       alias_of=graph.alias_of, output=graph.output, fusible=graph.fusible,
                       workspace=graph.workspace, tensor=graph.tensor, held=graph.held, lives_to=graph.lives_to)


def kept_for_backward(graph: Graph, schedule: Schedule) -> np.ndarray:
    """Forward nodes whose first computation serves a read in a backward node's stage (by
    the backward node itself or by a recomputation placed there)."""
    recomputed_at: dict[int, list[int]] = {}
    for i, s, _ in schedule.events:
        if s != i:
            recomputed_at.setdefault(i, []).append(s)
    kept = np.zeros(graph.n, dtype=bool)
    for k, s, _ in schedule.events:
        if not graph.backward[s]:
            continue
        for p in graph.preds[k].tolist():
            if graph.backward[p] or kept[p]:
                continue
            later = [r for r in recomputed_at.get(p, ()) if r < s or (r == s and p < k)]
            kept[p] = not later
    return kept



@dataclass(frozen=True, eq=False)
class SimResult:
    """What a schedule costs: peak bytes, total cost, and memory over the step.

    `curve` holds the live bytes at each computation (the instant its output is allocated)
    in execution order; `stage_peak` the highest such value per stage. With
    `simulate(..., allocations=True)`, `allocations` lists every allocation as rows
    (bytes, first, end) over `curve`'s indices: live at index c when first <= c < end
    (a storage from the computation that creates it, an op's workspace and the bytes the
    runtime holds at a computation for its own index).
    `shared` maps each computation (an index into the schedule's events) that writes its
    output over an input's storage to that input node.
    """

    peak_bytes: int
    cost: float
    baseline_cost: float
    curve: np.ndarray
    stage_peak: np.ndarray
    recomputations: int
    allocations: np.ndarray | None = None
    shared: dict[int, int] = field(default_factory=dict)

    @property
    def overhead(self) -> float:
        """Extra compute over the unplanned step, as a fraction of it."""
        return self.cost / self.baseline_cost - 1.0 if self.baseline_cost > 0 else 0.0


def simulate(graph: Graph, schedule: Schedule, *, allocations: bool = False,
             share: bool | frozenset[int] = False) -> SimResult:
    """Validate `schedule` on `graph` and price it; raises InvalidSchedule if it cannot run.
    `allocations=True` also records every allocation's bytes and lifetime (for layouts).

    `share=True` lets every computation of a pointwise op take over the storage of the
    input `graph.shareable` names when nothing else needs that storage after it (the
    in-place variant), so the op allocates nothing; a set of event indices shares exactly
    those computations and raises InvalidSchedule where one cannot.
    """
    n = graph.n
    if schedule.num_stages != n:
        raise InvalidSchedule(f"schedule has {schedule.num_stages} stages for a graph of {n} nodes", 0, 0)
    _check_events(graph, schedule)
    run = _Run(graph, schedule, allocations, share)
    bounds = np.searchsorted(schedule.stage, np.arange(n + 1)).tolist()
    for s in range(n):
        run.stage(s, bounds[s], bounds[s + 1])
    stage_peak = np.maximum.reduceat(run.curve, bounds[:-1]) if n else np.zeros(0, dtype=np.int64)
    storage = run.storage
    table = None
    if allocations:
        closed = storage.closed + [(size, first, len(run.curve)) for size, first in storage.opened.values()]
        table = np.array(closed, dtype=np.int64).reshape(-1, 3)
        table.setflags(write=False)
    run.curve.setflags(write=False)
    stage_peak.setflags(write=False)
    return SimResult(peak_bytes=int(run.curve.max()) if len(run.curve) else 0,
                     cost=float(graph.cost[schedule.node].sum()), baseline_cost=graph.total_cost,
                     curve=run.curve, stage_peak=stage_peak, recomputations=schedule.recomputations,
                     allocations=table, shared=run.shared)


def run_peak(graph: Graph, ops: Iterable[int], live: Iterable[int], keep: Iterable[int]) -> int:
    """The peak bytes of computing `ops` once each, in order, with the values `live` held
    from the start: `simulate`'s memory model for one pass with no recomputation, for
    models that price a piece of a step (the DP's block tables). Each op allocates while
    its inputs live; after it, whatever no later op of the pass reads is freed unless it
    is in `keep`. Inputs neither live nor computed in the pass count nothing."""
    ops, keep = list(ops), set(keep)
    last = {p: pos for pos, v in enumerate(ops) for p in graph.preds[v].tolist()}
    storage = _Storage(graph, allocations=False)
    held = sorted(set(live))
    for v in held:
        storage.hold(v, fresh=int(graph.alias_of[v]) not in held)
    peak = storage.bytes
    for pos, v in enumerate(ops):
        storage.hold(v)
        held.append(v)
        peak = max(peak, storage.bytes + int(graph.workspace[v]))
        dying = {p for p in held if last.get(p, -1) <= pos and p not in keep}
        for p in dying:
            storage.release(p)
        held = [p for p in held if p not in dying]
    return peak


def peak_floor(graph: Graph) -> int:
    """A least peak no schedule of `graph` goes below (none writing over its inputs):
    when a node is computed in its own stage, the parameters, the inputs, the outputs
    computed so far, the node's inputs and the node itself are live, and its workspace
    and the runtime's bytes of that stage count too. A budget under it is infeasible
    without solving anything: the parameters and their gradients of a large model often
    exceed it alone."""
    units, size = graph.units, graph.unit_size.tolist()
    workspace, held, output = graph.workspace.tolist(), graph.held.tolist(), graph.output.tolist()
    standing = {u for i in np.nonzero(graph.pinned)[0].tolist() for u in units[i]}
    standing_bytes = sum(size[u] for u in standing)
    floor = standing_bytes
    for v in range(graph.n):
        if graph.pinned[v]:
            continue
        live = {u for p in (*graph.pred_lists[v], v) for u in units[p]} - standing
        floor = max(floor, standing_bytes + sum(size[u] for u in live) + workspace[v] + held[v])
        if output[v]:
            standing_bytes += sum(size[u] for u in set(units[v]) - standing)
            standing |= set(units[v])
    return floor


class _Storage:
    """Storage instances and how many live values hold each: a computation of a node that
    owns storage opens fresh instances of its units, an alias holds its base's, and an
    instance's bytes count while anything holds it. `at` is the curve index allocations
    and frees are recorded against (with `allocations`)."""

    def __init__(self, graph: Graph, allocations: bool) -> None:
        self.units = graph.units
        self.unit_size = graph.unit_size.tolist()
        self.alias_of = graph.alias_of.tolist()
        self.is_part = graph.is_part.tolist()
        self.allocations = allocations
        self.of: list[dict[int, int]] = [{} for _ in range(graph.n)]
        self.holders: list[int] = []
        self.bytes = 0
        self.at = 0
        self.opened: dict[int, tuple[int, int]] = {}
        self.closed: list[tuple[int, int, int]] = []

    def hold(self, i: int, fresh: bool = False) -> None:
        """Node i becomes live: an alias or a part holds its base's instances (none if
        its base never lived), anything else, or anything with `fresh`, new ones."""
        base = self.alias_of[i]
        if fresh or base < 0:
            self.of[i] = {}
            for unit in self.units[i]:
                self.of[i][unit] = len(self.holders)
                self.holders.append(0)
        elif self.is_part[i]:
            self.of[i] = {i: self.of[base][i]} if i in self.of[base] else {}
        else:
            self.of[i] = self.of[base]
        for unit, instance in self.of[i].items():
            self.holders[instance] += 1
            if self.holders[instance] == 1:
                self.bytes += self.unit_size[unit]
                if self.allocations:
                    self.opened[instance] = (self.unit_size[unit], self.at)

    def take_over(self, k: int, instance: int) -> None:
        """Node k's output written over `instance`, which it now holds too."""
        self.of[k] = {k: instance}
        self.holders[instance] += 1

    def release(self, i: int) -> None:
        for unit, instance in self.of[i].items():
            self.holders[instance] -= 1
            if self.holders[instance] == 0:
                self.bytes -= self.unit_size[unit]
                if self.allocations:
                    self.closed.append((*self.opened.pop(instance), self.at))


class _Run:
    """One pass of `simulate` over a schedule's stages: which values are live until when,
    the memory curve, and which computations write over an input."""

    def __init__(self, graph: Graph, schedule: Schedule, allocations: bool, share: bool | frozenset[int]) -> None:
        n = graph.n
        self.share = share
        self.nodes, self.untils = schedule.node.tolist(), schedule.until.tolist()
        self.preds = graph.pred_lists
        self.workspace = graph.workspace.tolist()
        self.held = graph.held.tolist()
        self.runtime_held = schedule.held.tolist()
        self.throughs = schedule.through.tolist()
        self.through_of = [-1] * n
        self.late: dict[int, int] = {}
        self.resident = (graph.pinned | graph.output).tolist()
        self.shareable = graph.shareable.tolist() if share is not False else []
        self.storage = _Storage(graph, allocations)
        self.live_until = [-1] * n
        self.expiring: list[list[int]] = [[] for _ in range(n)]
        self.curve = np.zeros(len(schedule.node), dtype=np.int64)
        self.shared: dict[int, int] = {}

    def stage(self, s: int, lo: int, hi: int) -> None:
        """Run stage s (events lo..hi): free what is kept no further, then compute."""
        nodes = self.nodes[lo:hi]
        untils = self.untils[lo:hi]
        last_use: dict[int, int] = {}
        for pos, k in enumerate(nodes):
            for p in self.preds[k]:
                last_use[p] = pos
        self.late = self._kept_through(s, lo, nodes, last_use)
        self.storage.at = lo
        for i in self.expiring[s]:
            if self.live_until[i] == s and not self.resident[i] and i not in last_use and i not in self.late:
                self._free(i)
        if lo == hi or nodes[-1] != s:
            raise InvalidSchedule("the stage does not compute its own node", s, s)
        for pos, (k, u) in enumerate(zip(nodes, untils)):
            self._compute(k, u, s, lo + pos, pos, last_use)

    def _kept_through(self, s: int, lo: int, nodes: list[int], last_use: dict[int, int]) -> dict[int, int]:
        """The values ending in stage s whose `Schedule.through` keeps them alive past
        their last read there, each with the position they are freed after."""
        late: dict[int, int] = {}
        ending = [(i, self.through_of[i], -1) for i in self.expiring[s] if self.live_until[i] == s]
        ending += [(k, self.throughs[lo + pos], pos) for pos, k in enumerate(nodes) if self.untils[lo + pos] == s]
        for i, through, made in ending:
            held = bisect_right(nodes, through) - 1 if through >= 0 else -1
            if held > max(last_use.get(i, -1), made) and not self.resident[i]:
                late[i] = held
        return late

    def _compute(self, k: int, u: int, s: int, event: int, pos: int, last_use: dict[int, int]) -> None:
        """Computation `event` of node k in stage s, kept until stage u, then what dies with it."""
        live_until, storage, resident = self.live_until, self.storage, self.resident
        preds = self.preds[k]
        for p in preds:
            if live_until[p] < s:
                raise InvalidSchedule(f"input node {p} is not live", s, k)
        if live_until[k] >= s:
            raise InvalidSchedule("node is computed while a copy of it is still live", s, k)
        storage.at = event
        dying = [p for p in preds if live_until[p] == s and not resident[p] and last_use[p] == pos
                 and p not in self.late]
        dying += [i for i, held in self.late.items() if held == pos and i != k and live_until[i] == s]
        if len(dying) > 1:
            dying = list(dict.fromkeys(dying))
        instance = self._writes_over(k, s, event, dying) if self.share is not False else -1
        if instance >= 0:
            storage.take_over(k, instance)
            self.shared[event] = self.shareable[k]
        else:
            storage.hold(k)
        live_until[k] = u
        self.through_of[k] = self.throughs[event]
        if u > s:
            self.expiring[u].append(k)
        held = self.held[s] + self.runtime_held[event]
        self.curve[event] = storage.bytes + self.workspace[k] + held
        storage.at = event + 1
        for extra in (self.workspace[k], held) if storage.allocations else ():
            if extra:
                storage.closed.append((extra, event, event + 1))
        if u == s and not resident[k] and max(last_use.get(k, -1), self.late.get(k, -1)) <= pos:
            dying.append(k)
        for i in dying:
            self._free(i)

    def _writes_over(self, k: int, s: int, event: int, dying: list[int]) -> int:
        """The storage instance computation `event` (of node k) writes its output over, or
        -1: that of the input `Graph.shareable` names, when the values dying with this
        computation are all that hold it."""
        asked = self.share is True or (self.share is not False and event in self.share)
        if not asked:
            return -1
        p = self.shareable[k]
        instance = -1
        if p >= 0:
            ((_, candidate),) = self.storage.of[p].items()
            holding = sum(candidate in self.storage.of[q].values() for q in dying)
            instance = candidate if self.storage.holders[candidate] == holding else -1
        if instance < 0 and self.share is not True:
            raise InvalidSchedule("cannot write over the input's storage: it is still needed", s, k)
        return instance

    def _free(self, i: int) -> None:
        self.storage.release(i)
        self.live_until[i] = -1


def _check_events(graph: Graph, schedule: Schedule) -> None:
    """Structural checks that need no memory accounting."""
    n = graph.n
    last = n - 1
    node, stage, until = schedule.node, schedule.stage, schedule.until
    if len(node) and (node.min() < 0 or node.max() >= n):
        bad = int(np.nonzero((node < 0) | (node >= n))[0][0])
        raise InvalidSchedule("node does not exist", int(stage[bad]), int(node[bad]))
    if len(stage) and (stage.min() < 0 or stage.max() > last):
        bad = int(np.nonzero((stage < 0) | (stage > last))[0][0])
        raise InvalidSchedule("stage does not exist", int(stage[bad]), int(node[bad]))
    for k in range(len(node)):
        i, s, u = int(node[k]), int(stage[k]), int(until[k])
        if s < i:
            raise InvalidSchedule("node is computed before its own stage", s, i)
        if not s <= u <= last:
            raise InvalidSchedule(f"kept until stage {u}, outside [{s}, {last}]", s, i)
        if (graph.pinned[i] or graph.output[i]) and s == i and u != last:
            kind = "parameter/input" if graph.pinned[i] else "output"
            raise InvalidSchedule(f"{kind} must stay live to the last stage", s, i)
        if graph.pinned[i] and s != i:
            raise InvalidSchedule("a parameter/input cannot be recomputed", s, i)
