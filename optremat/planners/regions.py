"""Module regions: the plans the native runtime runs, and their exact price.

The native runtime runs the user's own forward. A plan picks module calls (regions) to
run under `torch.utils.checkpoint` (non-reentrant); within a region a selective policy
keyed by (op, occurrence of that op in the call) saves the outputs of some ops. When the
backward first unpacks a tensor the region's autograd nodes saved, the region's forward
reruns from its start: saved ops return their stored outputs, every other op runs again,
and the rerun stops at the last op whose autograd node saves a tensor (early stop; that
op runs only if its node saves its output, since autograd saves inputs before the kernel,
and then with the views of its outputs that follow it). Recomputed tensors the backward
reads live until their last reader; the others die within the rerun, once Python lets
go of them; a saved output stays in the policy's storage until the rerun is over; the
region's inputs live until the last of its autograd nodes has run. What checkpoint and
the runtime stash beside the tensors (RNG states, copies of buffers) is priced per call
(`RegionMap.stash`).

This module maps a traced step's nodes to regions and keys, lowers a keep set (which
forward tensors the backward should find stored) to regions, and prices what the runtime
executes as a Schedule on the graph, so `simulate()` prices plans exactly as they run.
No torch here: the torch facts (call stacks, random ops) arrive as plain data.
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Sequence

import numpy as np

from optremat.core.graph import Graph, writes_in_place
from optremat.core.schedule import InvalidSchedule, Schedule, SimResult, simulate
from optremat.heuristics.benefit import drop_order

Call = tuple[str, int]
"""A module call: the module's path and how many calls of it came before in the step."""

UNCOUNTED = ("getitem", "detach.default")
"""Graph ops no selective policy sees: Python's tuple indexing, and the detaches
checkpoint inserts a varying number of (PyTorch's SAC_IGNORED_OPS)."""


@dataclass(frozen=True)
class Region:
    """A module call run under checkpoint; the ops keyed in `saved` (op name, occurrence in
    the call) keep their outputs for the backward, every other op is recomputed."""

    path: str
    call: int
    saved: frozenset[tuple[str, int]] = frozenset()

    def to_json(self) -> list:
        return [self.path, self.call, sorted([op, k] for op, k in self.saved)]

    @classmethod
    def from_json(cls, data: list) -> "Region":
        path, call, saved = data
        return cls(path, int(call), frozenset((op, int(k)) for op, k in saved))


@dataclass(frozen=True, eq=False)
class Lowering:
    """The regions that run under checkpoint and the schedule they execute on the graph;
    `runtime_cost` is what the runtime itself adds (seconds): checkpoint's bookkeeping of
    each call and of each tensor it saves, and selective policies' look at every op of
    their region in the forward and again in the rerun."""

    regions: tuple[Region, ...]
    schedule: Schedule
    runtime_cost: float = 0.0


def span_path(path: str, start: int, stop: int) -> str:
    """The region path of children [start, stop) of the nn.Sequential at `path`."""
    return f"{path}[{start}:{stop}]"


def parse_span(path: str) -> tuple[str, int, int] | None:
    """(Sequential path, start, stop) of a span region's path, None for a module call (a
    module whose name holds brackets is never a region, so a region path with them is a span)."""
    match = re.fullmatch(r"(.*)\[([0-9]+):([0-9]+)\]", path)
    return None if match is None else (match.group(1), int(match.group(2)), int(match.group(3)))


def bracketed(path: str) -> bool:
    """Whether a module path holds brackets (an nn.ModuleDict key such as "layer[1]"),
    which region paths keep for spans: such a module, and what it holds, is never a region."""
    return "[" in path or "]" in path


@dataclass(frozen=True, eq=False)
class RegionMap:
    """A traced step seen as module calls: per graph node its stack of calls (empty for
    backward ops and sources), whether it draws random numbers, and (`grad_of`) per
    backward op the forward op whose autograd node runs it (-1 if none). `sequences`
    names the children of each nn.Sequential (by path, "" for the model itself): a run
    of consecutive children is a region too, as `checkpoint_sequential` makes them.
    `dispatch_seconds` is the cost of a selective policy's look at one op, `rerun_seconds`
    checkpoint's own cost per call it reruns and `pack_seconds` per tensor the call's
    autograd nodes save. `unit`, when given, names per node the FSDP unit running it: a
    region never spans two units, so its rerun finds its parameters gathered and never
    gathers them again. `rng_state_bytes` is one stash of the RNG state in the device's
    memory and `buffers` the node of each buffer the forward writes (by each of its names
    in `named_buffers(remove_duplicate=False)`): see `stash`. `not_rerun` are the calls
    checkpoint cannot rerun as they ran (handed a key/value cache made outside them,
    `tracing.kv_cache`, drawing
    from a generator it does not restore: their own `torch.Generator`, numpy's, Python's
    `random`, or changing their module's Python state): no region is one of them or
    spans one."""

    graph: Graph
    calls: tuple[tuple[Call, ...], ...]
    random: np.ndarray
    grad_of: np.ndarray
    sequences: dict[str, tuple[str, ...]]
    dispatch_seconds: float = 0.0
    unit: np.ndarray | None = None
    rerun_seconds: float = 0.0
    pack_seconds: float = 0.0
    rng_state_bytes: int = 0
    buffers: dict[str, int] = field(default_factory=dict)
    not_rerun: frozenset[Call] = frozenset()

    def stash(self, call: Call) -> "Stash":
        """What the runtime holds for `call` when it runs under checkpoint: checkpoint's
        copy of the RNG state from the call's forward until its autograd nodes are done,
        and another while the call reruns (`fork_rng`); `runtime.native`'s copy of each
        buffer the call's modules write (those under its path, or under its span's
        children), made as the call starts and dropped with the RNG state's (a second
        backward's rerun reads them again), and the copy
        the rerun runs on, dropped when the rerun ends unless an autograd node of the
        rerun saved it (BatchNorm's running statistics), then when the last op reading it
        has run (from the stage of the rerun: counted at every computation there)."""
        rerun, graph = self.reruns[call], self.graph
        written = self.copied(call)
        ran = {s for v in rerun.nodes for s in self.facts.ran[v]}
        read = {b: max((s for s in graph.succs[b].tolist() if s in ran), default=-1) for b in written}
        first, copies = rerun.nodes[0], int(graph.size[written].sum())
        spans = [(first, rerun.done, self.rng_state_bytes + copies)]
        spans += [(rerun.t, last, int(graph.size[b])) for b, last in read.items() if last >= 0]
        scratch = int(sum(graph.size[b] for b, last in read.items() if last < 0))
        return Stash(tuple(span for span in spans if span[2] and span[0] <= span[1]),
                     self.rng_state_bytes + copies + scratch)

    def copied(self, call: Call) -> list[int]:
        """The nodes of the buffers `call`'s modules write (those under its path, or under
        its span's children): the runtime copies them as the call starts and reruns it on
        copies."""
        span = None if call in self._module_calls else parse_span(call[0])
        roots = [call[0]] if span is None else list(self.sequences[span[0]][span[1]:span[2]])
        prefixes = tuple(f"{root}." if root else "" for root in roots)
        return sorted({b for name, b in self.buffers.items() if name.startswith(prefixes)})

    @cached_property
    def members(self) -> dict[Call, np.ndarray]:
        """Forward ops of each module call and of each span of a Sequential call, in run order."""
        out: dict[Call, list[int]] = {}
        for v, stack in enumerate(self.calls):
            for call in stack:
                out.setdefault(call, []).append(v)
            for span in self._spans_of(stack):
                out.setdefault(span, []).append(v)
        return {call: np.array(nodes, dtype=np.int64) for call, nodes in out.items()}

    def _spans_of(self, stack: tuple[Call, ...]) -> list[Call]:
        """The span regions holding a node run under `stack`: for each Sequential call in it
        (the model itself first) whose children run in order, every span of the child the
        node runs in."""
        found = []
        for call, _, child in self._sequential_steps(stack):
            if call in self._in_order and not bracketed(call[0]):
                found += [(span_path(call[0], a, b), call[1])
                          for tiling in _tilings(len(self.sequences[call[0]])).values()
                          for a, b in tiling if a <= child < b]
        return list(dict.fromkeys(found))

    def _sequential_steps(self, stack: tuple[Call, ...]) -> list[tuple[Call, Call, int]]:
        """(Sequential call, the call below it, the index of the child that call runs) for
        each Sequential call in `stack`, the model itself first; the index is -1 for a
        call that is not one of its children by path."""
        calls = ((("", 0),) if "" in self.sequences else ()) + stack
        steps = []
        for call, below in zip(calls, calls[1:]):
            children = self.sequences.get(call[0])
            if children is not None:
                steps.append((call, below, children.index(below[0]) if below[0] in children else -1))
        return steps

    @cached_property
    def _in_order(self) -> frozenset[Call]:
        """The Sequential calls whose child calls run their children in order, each once (a
        child with no ops may be missing), so that a span's ops are those of its children
        as the runtime runs them. A module listed twice in a Sequential has one path, so
        its second call reads as a step back, and that Sequential has no spans."""
        runs: dict[Call, dict[Call, int]] = {}
        for stack in self.calls:
            for call, below, child in self._sequential_steps(stack):
                runs.setdefault(call, {}).setdefault(below, child)
        return frozenset(call for call, children in runs.items()
                         if min(children.values()) >= 0 and _increasing(list(children.values())))

    @cached_property
    def _depth(self) -> dict[Call, int]:
        """How deep each module call runs in the call tree: 0 for the model itself."""
        depth = {("", 0): 0}
        for stack in self.calls:
            for d, call in enumerate(stack):
                depth[call] = d + 1
        return depth

    def structures(self) -> list[tuple[Call, ...]]:
        """Candidate region sets, each of calls that share no op: every module call at one
        depth of the call tree, and the spans of one length over every Sequential call at
        one depth (spans of Sequentials nested in one another overlap), less any call that
        spans two units or is handed a key/value cache."""
        depth = max((len(stack) for stack in self.calls), default=0)
        found = []
        for d in range(depth):
            calls = tuple(call for call in dict.fromkeys(stack[d] for stack in self.calls if len(stack) > d)
                          if self._runnable(call))
            if calls and calls not in found:
                found.append(calls)
        by_length: dict[tuple[int, int], list[Call]] = {}
        for call in self.members:
            if call in self._module_calls or not self._runnable(call):
                continue
            path, a, b = parse_span(call[0])
            for length, tiling in _tilings(len(self.sequences[path])).items():
                if (a, b) in tiling:
                    by_length.setdefault((length, self._depth[(path, call[1])]), []).append(call)
        for key in sorted(by_length):
            found.append(tuple(sorted(by_length[key], key=lambda c: int(self.members[c][0]))))
        return found

    def candidates(self) -> tuple[Call, ...]:
        """Every call and span some structure holds, once: the regions a plan picks from."""
        return tuple(dict.fromkeys(call for structure in self.structures() for call in structure))

    def _within_a_unit(self, call: Call) -> bool:
        return self.unit is None or len(set(self.unit[self.members[call]].tolist())) == 1

    def _runnable(self, call: Call) -> bool:
        """Whether checkpoint can run `call`: within one FSDP unit, rerun as it ran, and
        named so that a plan can say which (`bracketed`)."""
        return (self._within_a_unit(call) and call not in self._never_rerun
                and call not in self.bracketed_calls)

    @cached_property
    def _module_calls(self) -> frozenset[Call]:
        return frozenset(call for stack in self.calls for call in stack)

    @cached_property
    def bracketed_calls(self) -> list[Call]:
        """The module calls no plan checkpoints for their names (`bracketed`)."""
        return sorted(call for call in self._module_calls if bracketed(call[0]))

    @cached_property
    def last_write(self) -> dict[int, int]:
        """Per storage owner, the last forward op that writes it in place."""
        facts, graph = self.facts, self.graph
        return {int(facts.owner[graph.alias_of[w]]): w
                for w in np.nonzero(facts.in_place & ~graph.backward)[0].tolist()}

    @cached_property
    def _never_rerun(self) -> frozenset[Call]:
        """The calls `not_rerun`, and the spans over any of them."""
        found = set(self.not_rerun)
        for stack in self.calls:
            if self.not_rerun.intersection(stack):
                found.update(self._spans_of(stack))
        return frozenset(found)

    def keys(self, call: Call) -> dict[int, tuple[str, int]]:
        """Each op of a call keyed as a selective policy counts it: (op, occurrence)."""
        return self._keys[call]

    @cached_property
    def _keys(self) -> dict[Call, dict[int, tuple[str, int]]]:
        out: dict[Call, dict[int, tuple[str, int]]] = {}
        for call, members in self.members.items():
            seen: dict[str, int] = {}
            out[call] = {}
            for v in members.tolist():
                op = self.graph.ops[v]
                if op not in UNCOUNTED:
                    out[call][v] = (op, seen.get(op, 0))
                    seen[op] = seen.get(op, 0) + 1
        return out

    @cached_property
    def facts(self) -> "_Facts":
        return _Facts.of(self.graph, self.grad_of)

    @cached_property
    def reruns(self) -> dict[Call, "Rerun | None"]:
        """How each call and span reruns under checkpoint (`rerun_of`), None for those that
        cannot be checkpointed."""
        return {call: rerun_of(self, call) for call in self.members}


@dataclass(frozen=True)
class Stash:
    """Bytes the runtime holds beside the graph's tensors for one checkpointed call:
    `spans` of (first stage, last stage, bytes) held at every computation of those
    stages, and `rerun_bytes` more at each computation of the call's rerun."""

    spans: tuple[tuple[int, int, int], ...]
    rerun_bytes: int


@dataclass(frozen=True, eq=False)
class _Facts:
    """Per node: the backward ops reading it, the last forward op reading it, the backward
    ops its autograd node runs that read forward tensors (those unpack what the node saved),
    the forward tensors they read (what the node saves) and all it runs; the op owning its
    storage; and storages written in place."""

    backward_reads: list[list[int]]
    last_forward_read: np.ndarray
    unpacks: list[list[int]]
    saved: list[list[int]]
    ran: list[list[int]]
    owner: np.ndarray
    overwritten: np.ndarray
    in_place: np.ndarray

    @classmethod
    def of(cls, graph: Graph, grad_of: np.ndarray) -> "_Facts":
        n = graph.n
        backward_reads: list[list[int]] = [[] for _ in range(n)]
        last = np.full(n, -1, dtype=np.int64)
        for v in range(n):
            for s in graph.succs[v].tolist():
                if graph.backward[s]:
                    backward_reads[v].append(s)
                else:
                    last[v] = max(last[v], s)
        unpacks: list[list[int]] = [[] for _ in range(n)]
        ran: list[list[int]] = [[] for _ in range(n)]
        for s in np.nonzero(graph.backward & (grad_of >= 0))[0].tolist():
            ran[int(grad_of[s])].append(s)
            if any(not graph.backward[p] for p in graph.preds[s].tolist()):
                unpacks[int(grad_of[s])].append(s)
        saved = [sorted({p for s in unpacks[v] for p in graph.preds[s].tolist() if not graph.backward[p]})
                 for v in range(n)]
        root = graph.storage_root
        owner = np.where(graph.is_part[root], graph.alias_of[root], root)
        in_place = np.array([bool(graph.alias_of[v] >= 0) and writes_in_place(graph.ops[v])
                             for v in range(n)], dtype=bool)
        overwritten = np.zeros(n, dtype=bool)
        overwritten[owner[graph.alias_of[in_place]]] = True
        return cls(backward_reads, last, unpacks, saved, ran, owner, overwritten, in_place)


def _increasing(values: list[int]) -> bool:
    return all(a < b for a, b in zip(values, values[1:]))


def _tilings(count: int) -> dict[int, list[tuple[int, int]]]:
    """Ways to cut a Sequential of `count` children into runs of consecutive children: runs
    of 2, 3, 4 and about the square root of `count` children."""
    lengths = sorted({2, 3, 4, max(2, round(count ** 0.5))})
    return {length: [(a, min(a + length, count)) for a in range(0, count, length)]
            for length in lengths if length < count}


@dataclass(frozen=True, eq=False)
class Rerun:
    """What checkpointing one call does, whatever its policy saves: the rerun starts at
    stage `t` (the first unpack of a tensor its autograd nodes saved) and computes the
    `recomputable` nodes whose owner is not saved, stopping at `stop` (`last`, the last op
    whose autograd node saves a tensor, or the node before it) and the views of it that
    follow; its `external` inputs live until `released`, and checkpoint's record of the
    call (`RegionMap.stash`) through stage `done`, the last op its autograd nodes run. A
    policy may save the `saveable` ops (keyed, not random, not written over, up to
    `last`) and must save the owners of `read_after` (outputs the backward reads after the
    call, and results of the step, which the caller holds), else the call cannot be
    checkpointed.
    `cost` is checkpoint's own bookkeeping (per call and per saved tensor);
    `policy_looks` the ops a selective policy looks at, in the forward and again in the
    rerun."""

    nodes: tuple[int, ...]
    last: int
    stop: int
    t: int
    released: int
    done: int
    recomputable: tuple[int, ...]
    saveable: frozenset[int]
    read_after: frozenset[int]
    external: tuple[int, ...]
    cost: float
    policy_looks: int


def rerun_of(rmap: RegionMap, call: Call) -> Rerun | None:
    """How `call` reruns under checkpoint, None when it cannot be checkpointed: its
    autograd nodes save nothing, its rerun would write over a tensor from outside it
    (but the buffers its modules write, which the runtime gives reruns copies of,
    `RegionMap.copied`: an input of the model, a tensor attribute), or a tensor from
    outside that its rerun reads is written in place after that, by the call itself (a
    residual `x += f(x)` at its end) or after it (the rerun would read the new values;
    checkpoint refuses them)."""
    found = _rerun(rmap, call)
    return found if isinstance(found, Rerun) else None


def never_rerun_because(rmap: RegionMap, call: Call) -> str | None:
    """Why no plan checkpoints `call` though its autograd nodes save tensors (`rerun_of`'s
    writes and reads in place), for a refusal to name; None when it can be, or saves
    nothing."""
    found = _rerun(rmap, call)
    return (found or None) if isinstance(found, str) else None


def _rerun(rmap: RegionMap, call: Call) -> Rerun | str:
    """`rerun_of`'s Rerun, or why there is none ("" when the call saves nothing)."""
    graph, facts, keys = rmap.graph, rmap.facts, rmap.keys(call)
    nodes = rmap.members[call].tolist()
    inside = set(nodes)
    packers = [v for v in nodes if facts.unpacks[v]]
    if not packers:
        return ""
    last, end = max(packers), nodes[-1]
    copied = set(rmap.copied(call))
    rerun_reads = {int(facts.owner[p]) for v in nodes if v <= last for p in graph.preds[v].tolist() if p not in inside}
    written = [int(facts.owner[graph.alias_of[v]]) for v in nodes
               if facts.in_place[v] and int(facts.owner[graph.alias_of[v]]) not in inside | copied
               and (v <= last or int(facts.owner[graph.alias_of[v]]) in rerun_reads)]
    if written:
        return f"writes in place over {_described(graph, written[0])}, which a rerun would write again"
    read = {int(facts.owner[p]) for v in nodes for p in graph.preds[v].tolist() if p not in inside} - copied
    later = sorted(owner for owner in read if rmap.last_write.get(owner, -1) > end)
    if later:
        return f"reads {_described(graph, later[0])}, which is written in place after it: a rerun would read it written"

    stop = last if _saves_its_output(rmap, last) else last - 1
    t = min(s for v in nodes for s in facts.unpacks[v])
    done = max([t] + [s for v in nodes for s in facts.ran[v]])
    released = min(done + 1, graph.n - 1)
    counted = [v for v in nodes if graph.ops[v] != "getitem"]
    recomputable = [v for v in nodes if v <= stop and int(facts.owner[v]) in inside]
    return Rerun(
        nodes=tuple(nodes), last=last, stop=stop, t=t, released=released, done=done,
        recomputable=tuple(recomputable + _stop_views(rmap, nodes, stop, set(recomputable))),
        saveable=frozenset(o for o in nodes if o in keys and o <= last and not rmap.random[o]
                           and not facts.overwritten[o]),
        read_after=frozenset(v for v in nodes if v <= last and (graph.output[v] or facts.backward_reads[v]
                                                                and facts.last_forward_read[v] > end)),
        external=tuple(sorted({p for v in nodes for p in graph.preds[v].tolist()
                               if p not in inside and not graph.pinned[p]})),
        cost=rmap.rerun_seconds + rmap.pack_seconds * sum(len(facts.saved[v]) for v in nodes),
        policy_looks=len(counted) + sum(v <= last for v in counted))


def _described(graph: Graph, node: int) -> str:
    """A tensor from outside a call, as a refusal names it."""
    if graph.kind[node] == "param":
        return f"a parameter or buffer of {graph.module[node] or 'the model'}"
    if graph.kind[node] == "input":
        return "an input of the step"
    return f"a tensor {graph.module[node] or 'the model'} computes"


def _stop_views(rmap: RegionMap, nodes: list[int], stop: int, recomputed: set[int]) -> list[int]:
    """The views and parts of a rerun's last op that the trace lists right after it (the
    outputs of a multi-output op, the detach autograd saves an output through): the rerun
    makes them with the op, and the backward reads them, not the forward's. Those the
    step reads after the call (its outputs) stay the forward's."""
    graph, facts = rmap.graph, rmap.facts
    end, views = nodes[-1], []
    for v in (v for v in nodes if v > stop):
        if graph.alias_of[v] < 0 or int(graph.alias_of[v]) not in recomputed | set(views):
            break
        if not graph.output[v] and facts.last_forward_read[v] <= end:
            views.append(v)
    return views


def lower(rmap: RegionMap, structure: Sequence[Call], kept: np.ndarray) -> Lowering:
    """The regions of `structure` (calls that share no op) that realise `kept` (forward
    nodes the backward should find stored), and the schedule the runtime then executes."""
    _check_disjoint(rmap, structure)
    graph = rmap.graph
    recompute: dict[int, list[int]] = {}
    held: dict[int, int] = {}
    through: dict[int, tuple[int, int]] = {}
    stashes = []
    regions = []
    runtime_cost = 0.0
    for call in structure:
        rerun = rmap.reruns.get(call)
        chosen = None if rerun is None else _region(rmap, rerun, kept)
        if chosen is None:
            continue
        saved_ops, recomputed = chosen
        if saved_ops:
            runtime_cost += rerun.policy_looks * rmap.dispatch_seconds
        runtime_cost += rerun.cost
        recompute.setdefault(rerun.t, []).extend(recomputed)
        for p in rerun.external:
            held[p] = max(held.get(p, rerun.released), rerun.released)
        for o in saved_ops:
            held[o] = max(held.get(o, rerun.t), rerun.t)
            through[o] = (rerun.t, max(rerun.recomputable))
        stashes.append((rerun.t, recomputed, rmap.stash(call)))
        keys = rmap.keys(call)
        regions.append(Region(call[0], call[1], frozenset(keys[o] for o in saved_ops)))
    schedule = _schedule(graph, recompute, held)
    return Lowering(tuple(regions), schedule.running(_stashed(schedule, stashes), _through(graph, schedule, through)),
                    runtime_cost)


def _stashed(schedule: Schedule, stashes: list[tuple[int, list[int], Stash]]) -> np.ndarray:
    """Per event of `schedule`, the bytes the runtime holds for its checkpointed calls
    (the stage a call reruns in, the nodes it recomputes, its `Stash`)."""
    held = np.zeros(len(schedule.node), dtype=np.int64)
    for t, recomputed, stash in stashes:
        for first, last, nbytes in stash.spans:
            held[(schedule.stage >= first) & (schedule.stage <= last)] += nbytes
        held[[schedule.event_index[(v, t)] for v in recomputed]] += stash.rerun_bytes
    return held


def _through(graph: Graph, schedule: Schedule, saved: dict[int, tuple[int, int]]) -> np.ndarray:
    """Per event of `schedule`, the last node whose computation in the stage its `until`
    ends in keeps it alive (`Schedule.through`): a saved op's output stays in the
    selective policy's storage until its call's rerun is over (`saved`: per saved op the
    stage its call reruns in and the call's last recomputable node), and Python holds a
    rerun's tensors as the forward held them (`Graph.lives_to`), until the rerun is over
    at the latest."""
    through = np.full(len(schedule.node), -1, dtype=np.int64)
    for e, (v, s, u) in enumerate(schedule.events):
        if s == v and v in saved and u == saved[v][0]:
            through[e] = saved[v][1]
        elif s != v and u == s:
            through[e] = graph.lives_to[v]
    return through


def _check_disjoint(rmap: RegionMap, structure: Sequence[Call]) -> None:
    """Raise ValueError naming two calls of `structure` that share an op: a call nested in
    another reruns within the other's rerun, which no schedule here prices."""
    seen: dict[int, Call] = {}
    for call in structure:
        for v in rmap.members[call].tolist():
            other = seen.setdefault(v, call)
            if other != call:
                raise ValueError(f"regions {other[0]!r} (call {other[1]}) and {call[0]!r} (call {call[1]}) share "
                                 "ops; checkpoint one of them")


def _region(rmap: RegionMap, rerun: Rerun, kept: np.ndarray) -> tuple[list[int], list[int]] | None:
    """(ops saved, nodes recomputed) of a call checkpointed to realise `kept`, or None
    when it runs plainly: `kept` stores every tensor of it the backward reads, nothing it
    would recompute up to its stop (the views of its stop op aside) is read by the
    backward, or an output the backward reads after the call cannot be saved (the rerun
    would make a second copy of a tensor still live)."""
    facts = rmap.facts
    if all(kept[v] for v in rerun.nodes if facts.backward_reads[v]):
        return None
    saved_ops = {int(facts.owner[v]) for v in rerun.nodes if v <= rerun.last and (kept[v] or v in rerun.read_after)}
    saved_ops &= rerun.saveable
    recomputed = [v for v in rerun.recomputable if int(facts.owner[v]) not in saved_ops]
    if not any(facts.backward_reads[v] for v in recomputed if v <= rerun.stop):
        return None
    if any(v in rerun.read_after for v in recomputed):
        return None
    return sorted(saved_ops), recomputed


def _saves_its_output(rmap: RegionMap, v: int) -> bool:
    """Whether the autograd node of `v` saves an output of `v` (its backward ops read
    storage `v` owns). Autograd saves an op's inputs before its kernel runs and its
    outputs after, so a rerun's early stop at the last op that saves tensors computes
    that op only when it saves an output."""
    facts = rmap.facts
    return any(facts.owner[p] == v for p in facts.saved[v])


def _schedule(graph: Graph, recompute: dict[int, list[int]], held: dict[int, int]) -> Schedule:
    """Each node in its own stage, plus the recomputations. A recomputed copy lives until
    its last backward reader from the recomputation on; a reader before it (an autograd
    node outside the region that saved the tensor itself) holds the original, and so does
    the eager step as long as it holds it (`Graph.held_until`). A region's inputs live
    until its autograd nodes release them, a saved op's output until its call reruns
    (`held`: the stage each lives into)."""
    n = graph.n
    until = np.arange(n)
    again: dict[tuple[int, int], int] = {}
    recomputed_at = {v: t for t, nodes in recompute.items() for v in nodes}
    for v in range(n):
        t = recomputed_at.get(v)
        for s in graph.succs[v].tolist():
            if graph.backward[s] and t is not None and s >= t:
                again[(v, t)] = max(again.get((v, t), t), s)
            else:
                until[v] = max(until[v], s)
    for t, nodes in recompute.items():
        for v in nodes:
            again.setdefault((v, t), t)
            for p in graph.preds[v].tolist():
                if recomputed_at.get(p) != t:
                    until[p] = max(until[p], t)
    for v, t in held.items():
        until[v] = max(until[v], t)
    until = np.maximum(until, graph.held_until)
    until[graph.pinned | graph.output] = n - 1
    events = [(v, v, int(until[v])) for v in range(n)] + [(v, t, u) for (v, t), u in again.items()]
    return Schedule.from_events(events, n)


def kept_of(rmap: RegionMap, regions: Sequence[Region]) -> tuple[tuple[Call, ...], np.ndarray]:
    """The structure and keep set that lower to `regions` on this map (a plan made at one
    input shape, read at another): every op outside the regions and every op a region's
    policy saves is kept."""
    kept = np.ones(rmap.graph.n, dtype=bool)
    structure = []
    for region in regions:
        call = (region.path, region.call)
        if call not in rmap.members:
            continue
        structure.append(call)
        kept[rmap.members[call]] = False
        for v, key in rmap.keys(call).items():
            kept[v] = key in region.saved
    return tuple(structure), kept


@dataclass(frozen=True, eq=False)
class Priced:
    """A lowering and its simulation, with what produced it: `cost` and `overhead` count
    the graph's computations and the runtime's own cost."""

    lowering: Lowering
    result: SimResult
    source: str

    @property
    def cost(self) -> float:
        return self.result.cost + self.lowering.runtime_cost

    @property
    def overhead(self) -> float:
        return self.cost / self.result.baseline_cost - 1.0 if self.result.baseline_cost > 0 else 0.0


def price(rmap: RegionMap, structure: Sequence[Call], kept: np.ndarray, source: str) -> Priced:
    lowering = lower(rmap, structure, kept)
    return Priced(lowering, simulate(rmap.graph, lowering.schedule), source)


def search(rmap: RegionMap, budget: int, solver_kept: np.ndarray | None, deadline: float = math.inf,
           have: Sequence[Priced] = ()) -> list[Priced]:
    """Region plans that compete for `budget`, one family per structure (depth of the call
    tree): the solver's keep set and keeping everything, each less the shortest prefix of
    the benefit order that fits; checkpointing the first k regions whole (the smallest k
    that fits); and that plan, and every region checkpointed, with the most
    expensive-to-recompute ops saved again while it still fits. The first k regions are
    those that free the most memory per second of recomputation. Per-block checkpointing
    (every call whose ops repeat in another call of the structure, checkpointed whole)
    competes too, so a plan is never worse than it where it fits. Past `deadline` (of
    `time.perf_counter`), once a plan found or among `have` fits, no further structure is
    searched: on a 40-layer Llama each takes seconds of whole-step simulations."""
    graph = rmap.graph
    order = drop_order(graph)
    found: list[Priced] = []
    for structure in rmap.structures():
        if time.perf_counter() > deadline and any(c.result.peak_bytes <= budget for c in (*found, *have)):
            break
        try:
            found += _seeds(rmap, structure, budget, order, solver_kept)
        except InvalidSchedule:
            continue  # some region set of it does not lower; the exact search still covers its calls
    return found


def whole_calls(rmap: RegionMap) -> list[Priced]:
    """Per structure, every call of it checkpointed whole: the least peaks region plans
    reach without a search (one simulation each), for naming the least peak when a
    budget is refused anyway."""
    found = []
    for structure in rmap.structures():
        try:
            found.append(_whole(rmap, structure, len(structure)))
        except InvalidSchedule:
            continue
    return found


def _seeds(rmap: RegionMap, structure: tuple[Call, ...], budget: int, order: np.ndarray,
           solver_kept: np.ndarray | None) -> list[Priced]:
    """The region plans of one structure that `search` seeds the exact search with."""
    graph = rmap.graph
    found = []
    inside = np.zeros(graph.n, dtype=bool)
    for call in structure:
        inside[rmap.members[call]] = True
    starts = [("solver", solver_kept)] if solver_kept is not None else []
    starts.append(("benefit", np.ones(graph.n, dtype=bool)))
    for label, start in starts:
        drops = [v for v in order.tolist() if start[v] and inside[v]]
        found.append(_shortest(lambda k: _dropping(rmap, structure, start, drops[:k], label),
                               len(drops), budget))
    ranked = _by_yield(rmap, structure)
    whole = _shortest(lambda k: _whole(rmap, ranked, k), len(ranked), budget)
    found.append(whole)
    for start in (whole, _whole(rmap, structure, len(structure))):
        found.append(_saved_again(rmap, structure, inside, start, budget))
    blocks = _repeated(rmap, structure)
    if blocks and len(blocks) < len(structure):
        found.append(_whole(rmap, blocks, len(blocks)))
    return found


def _saved_again(rmap: RegionMap, structure: Sequence[Call], inside: np.ndarray, start: Priced,
                 budget: int) -> Priced:
    """`start` with the ops that cost the most per byte to recompute saved again, as many
    as still fit (the matmuls of a block saved, its pointwise ops recomputed)."""
    graph = rmap.graph
    base = _kept_by(start.lowering, rmap)
    dropped = np.nonzero(inside & ~base)[0]
    again = dropped[np.argsort(-graph.cost[dropped] / np.maximum(graph.size[dropped], 1), kind="stable")]
    return _longest(lambda k: _readding(rmap, structure, base, again[:k]), len(again), budget, start)


def _dropping(rmap: RegionMap, structure: Sequence[Call], start: np.ndarray, drops: list[int],
              label: str) -> Priced:
    kept = start.copy()
    kept[drops] = False
    return price(rmap, structure, kept, label)


def _by_yield(rmap: RegionMap, structure: Sequence[Call]) -> list[Call]:
    """The calls of `structure`, those that free the most bytes the backward reads per
    second of recomputation first (ties in run order)."""
    graph, reads = rmap.graph, rmap.facts.backward_reads

    def freed_per_second(call: Call) -> float:
        members = rmap.members[call]
        freed = sum(int(graph.size[v]) for v in members.tolist() if reads[v])
        return freed / max(float(graph.cost[members].sum()), 1e-12)

    return sorted(structure, key=lambda call: (-freed_per_second(call), int(rmap.members[call][0])))


def _repeated(rmap: RegionMap, structure: Sequence[Call]) -> list[Call]:
    """The calls of `structure` running the same ops as another call of it: the blocks of
    a stack, which per-block checkpointing checkpoints."""
    ops = {call: tuple(rmap.graph.ops[v] for v in rmap.members[call].tolist()) for call in structure}
    seen = Counter(ops.values())
    return [call for call in structure if seen[ops[call]] > 1]


def _whole(rmap: RegionMap, structure: Sequence[Call], count: int) -> Priced:
    kept = np.ones(rmap.graph.n, dtype=bool)
    for call in structure[:count]:
        kept[rmap.members[call]] = False
    return price(rmap, structure, kept, "per-region")


def _readding(rmap: RegionMap, structure: Sequence[Call], base: np.ndarray, again: np.ndarray) -> Priced:
    kept = base.copy()
    kept[again] = True
    return price(rmap, structure, kept, "per-region+saves")


def _kept_by(lowering: Lowering, rmap: RegionMap) -> np.ndarray:
    """The keep set a lowering realises (its regions' saved ops; everything outside them)."""
    return kept_of(rmap, lowering.regions)[1] if lowering.regions else np.ones(rmap.graph.n, dtype=bool)


def _shortest(attempt: Callable[[int], Priced], count: int, budget: int) -> Priced:
    """The attempt with the smallest argument in [0, count] that fits `budget` (binary
    search: peaks fall, though not strictly, as the argument grows), else the last one."""
    first = attempt(0)
    if first.result.peak_bytes <= budget or count == 0:
        return first
    best = attempt(count)
    if best.result.peak_bytes > budget:
        return best
    lo, hi = 1, count
    while lo < hi:
        mid = (lo + hi) // 2
        trial = attempt(mid)
        if trial.result.peak_bytes <= budget:
            best, hi = trial, mid
        else:
            lo = mid + 1
    return best


def _longest(attempt: Callable[[int], Priced], count: int, budget: int, start: Priced) -> Priced:
    """The attempt with the largest argument in [0, count] that still fits, from `start`
    (argument 0, returned as it is when it does not fit)."""
    if start.result.peak_bytes > budget:
        return start
    best, lo, hi = start, 1, count
    while lo <= hi:
        mid = (lo + hi) // 2
        trial = attempt(mid)
        if trial.result.peak_bytes <= budget:
            best, lo = trial, mid + 1
        else:
            hi = mid - 1
    return best
