"""Execution order: the order of independent ops changes the peak.

A traced step runs ops in the order the model's Python issued them. Any topological
order computes the same step, and some hold less at once: a parameter's gradient can be
accumulated as soon as its inputs exist, a branch finished before the next starts.
`min_memory_order` schedules greedily, always running the ready op that adds the fewest
bytes net of what it lets free (the list-scheduling counterpart of memonger's
longest-path ordering), and never moves an in-place op before an op that reads the
storage it overwrites; `best_order` keeps it only where `simulate()` confirms a lower
unplanned peak. Planners then run on the reordered graph like any other, and compiled
graphs run it (`compile_backend(..., order="best")`).
"""

from __future__ import annotations

import re

import numpy as np

from optremat.core.graph import Graph, writes_in_place
from optremat.core.schedule import keep_all, simulate


def reorder(graph: Graph, order: np.ndarray) -> Graph:
    """`graph` with its nodes renumbered so that node `order[k]` becomes node k."""
    order = np.asarray(order, dtype=np.int64)
    if sorted(order.tolist()) != list(range(graph.n)):
        raise ValueError("order must be a permutation of the graph's nodes")
    new = np.empty(graph.n, dtype=np.int64)
    new[order] = np.arange(graph.n)
    alias = graph.alias_of[order]
    columns = {name: [getattr(graph, name)[i] for i in order.tolist()]
               for name in ("names", "ops", "kind", "module", "cost", "size", "backward", "output", "fusible",
                            "workspace", "held")}
    lives_to = graph.lives_to[order]
    return Graph.build(edges=[(int(new[a]), int(new[b])) for a, b in graph.edges.tolist()],
                       alias_of=np.where(alias >= 0, new[np.maximum(alias, 0)], -1).tolist(),
                       lives_to=np.where(lives_to >= 0, new[np.maximum(lives_to, 0)], -1).tolist(),
                       tensor=[graph.tensor[i] for i in order.tolist()] if len(graph.tensor) == graph.n else None,
                       **columns)


RANDOM = re.compile(r"(bernoulli|native_dropout|rand|randn|randint|rand_like|randn_like|normal|uniform|"
                    r"multinomial|randperm|random|exponential|geometric|cauchy|log_normal)_?\.")


def min_memory_order(graph: Graph, late: np.ndarray | None = None) -> np.ndarray:
    """A topological order that greedily keeps live bytes low (ties keep the traced order).

    Nodes marked in `late` run only after every other op (a compiled step's backward
    cannot start before the loss has run on the model's output), and random ops keep their traced
    order, so each draws the numbers it drew when traced."""
    n = graph.n
    root = np.arange(n)
    for v in range(n):
        if graph.alias_of[v] >= 0:
            root[v] = root[graph.alias_of[v]]
    allocates = np.array([sum(int(graph.unit_size[u]) for u in graph.units[v]) if graph.alias_of[v] < 0 else 0
                          for v in range(n)], dtype=np.int64)
    storage = np.zeros(n, dtype=np.int64)
    np.add.at(storage, root, allocates)
    resident = np.zeros(n, dtype=bool)
    np.logical_or.at(resident, root, graph.pinned | graph.output)
    readers: list[set[int]] = [set() for _ in range(n)]
    for a, b in graph.edges.tolist():
        readers[root[a]].add(b)
    remaining = np.array([len(r) for r in readers], dtype=np.int64)
    after = [set(graph.succs[v].tolist()) for v in range(n)]
    for v in range(n):
        if graph.alias_of[v] >= 0 and writes_in_place(graph.ops[v]):
            for u in readers[root[v]]:
                if u < v:
                    after[u].add(v)
    random = [v for v in range(n) if RANDOM.match(graph.ops[v])]
    for a, b in zip(random, random[1:]):
        after[a].add(b)
    late = np.zeros(n, dtype=bool) if late is None else np.asarray(late, dtype=bool)
    missing = np.zeros(n, dtype=np.int64)
    for v in range(n):
        for s in after[v]:
            missing[s] += 1
    early = int((~late & ~graph.pinned).sum())
    sources = np.nonzero(missing == 0)[0].tolist()
    waiting = [v for v in sources if late[v] and early]
    ready = set(sources) - set(waiting)
    order: list[int] = []

    def run(v: int) -> None:
        nonlocal early
        ready.remove(v)
        order.append(v)
        if not late[v] and not graph.pinned[v]:
            early -= 1
            if early == 0:
                ready.update(waiting)
        for g in {int(root[p]) for p in graph.preds[v].tolist()}:
            remaining[g] -= 1
        for s in after[v]:
            missing[s] -= 1
            if missing[s] == 0:
                if late[s] and early:
                    waiting.append(s)
                else:
                    ready.add(s)

    for v in np.nonzero(graph.pinned)[0].tolist():
        run(v)
    while ready:
        def net(v: int) -> tuple[int, int]:
            groups = {int(root[p]) for p in graph.preds[v].tolist()}
            freed = sum(int(storage[g]) for g in groups if remaining[g] == 1 and not resident[g])
            return int(allocates[v]) - freed, v

        run(min(ready, key=net))
    return np.array(order, dtype=np.int64)


def sunk_views(graph: Graph) -> Graph:
    """`graph` with every backward view (an alias that neither allocates nor writes: a
    view, a detach) moved to just before its first reader. A traced joint graph places
    some early (autograd's detach of an output it saves comes right after the loss),
    where a plan that recomputes the viewed tensor would have to recompute it; autograd's
    engine, and PyTorch's partitioner, run a view when it is read."""
    movable = graph.backward & (graph.alias_of >= 0) & (graph.size == 0) & ~graph.output
    movable &= np.array([not writes_in_place(op) for op in graph.ops], dtype=bool)
    order: list[int] = []
    placed = np.zeros(graph.n, dtype=bool)

    def place(v: int) -> None:
        for p in graph.preds[v].tolist():
            if movable[p] and not placed[p]:
                place(p)
        placed[v] = True
        order.append(v)

    for v in np.nonzero(~movable)[0].tolist():
        place(v)
    for v in np.nonzero(~placed)[0].tolist():
        place(v)
    return reorder(graph, np.array(order)) if order != list(range(graph.n)) else graph


def best_order(graph: Graph, late: np.ndarray | None = None) -> tuple[Graph, np.ndarray]:
    """The graph in whichever order, traced or `min_memory_order`, has the lower
    unplanned peak, with the order used (node k of the result is node order[k])."""
    order = min_memory_order(graph, late)
    candidate = reorder(graph, order)
    if simulate(candidate, keep_all(candidate)).peak_bytes < simulate(graph, keep_all(graph)).peak_bytes:
        return candidate, order
    return graph, np.arange(graph.n)
