"""Exhaustive search for the cheapest schedule under a budget, for graphs of a few nodes.

Written from the memory-model rules alone, stage by stage: every subset of nodes a stage
may compute, every subset of live tensors it may keep into the next stage, with each
live tensor tracked by the storage (allocation, unit) pairs it holds. The winner is
rebuilt as a Schedule and checked with `simulate` by the tests. With `share`, an op that
`Graph.shareable` allows writes over its input whenever every holder of that input's
storage lets go of it at this op: the op then allocates nothing at that instant.
"""

from __future__ import annotations

from itertools import chain, combinations

from optremat import Graph, Schedule

Live = frozenset  # of (node, first stage, storage keys)


def _subsets(items: list[int]) -> chain:
    return chain.from_iterable(combinations(items, r) for r in range(len(items) + 1))


def optimum(g: Graph, budget: int, share: bool = False) -> tuple[float, Schedule] | None:
    """(least cost, a schedule reaching it), or None when no schedule fits `budget`."""
    n = g.n
    forever = g.pinned | g.output
    resident = {(i, i, frozenset(((i, -1), u) for u in g.units[i])) for i in range(n) if g.pinned[i]}
    states: dict[Live, tuple[float, tuple]] = {Live(resident): (0.0, ())}
    for t in range(int(g.pinned.sum()), n):
        nxt: dict[Live, tuple[float, tuple]] = {}
        for live, (cost, events) in states.items():
            live_nodes = {node for node, _, _ in live}
            spare = [i for i in range(t) if not g.pinned[i] and i not in live_nodes]
            for extra in _subsets(spare):
                run = sorted(extra) + [t]
                outcome = _run_stage(g, t, live, run)
                if outcome is None:
                    continue
                computed, reads = outcome
                candidates = [x for x in computed + sorted(live)
                              if not forever[x[0]] and len(g.succs[x[0]])]
                for kept in _subsets(list(range(len(candidates)))):
                    keep = {candidates[k] for k in kept} | {x for x in computed + list(live) if forever[x[0]]}
                    peak = _stage_peak(g, live, computed, reads, keep, share)
                    if peak > budget:
                        continue
                    freed = tuple((x[0], x[1], t) for x in computed + list(live) if x not in keep)
                    total = cost + float(g.cost[list(run)].sum())
                    state = Live(keep)
                    if state not in nxt or total < nxt[state][0]:
                        nxt[state] = (total, events + freed)
        states = nxt
    if not states:
        return None
    final, (cost, events) = min(states.items(), key=lambda item: item[1][0])
    return cost, Schedule.from_events(list(events) + [(node, first, n - 1) for node, first, _ in final], n)


def _run_stage(g: Graph, t: int, live: Live, run: list[int]) -> tuple[list, list] | None:
    """The tensors `run` computes in stage t and, per computation, the tensors it reads;
    None when some input is not live."""
    available = {node: x for x in live for node in [x[0]]}
    computed, reads = [], []
    for k in run:
        inputs = []
        for p in g.preds[k].tolist():
            if p not in available:
                return None
            inputs.append(available[p])
        if g.alias_of[k] >= 0:
            base_keys = available[int(g.alias_of[k])][2]
            keys = frozenset(key for key in base_keys if key[1] == k) if g.is_part[k] else base_keys
        else:
            keys = frozenset(((k, t), u) for u in g.units[k])
        x = (k, t, keys)
        available[k] = x
        computed.append(x)
        reads.append(inputs)
    return computed, reads


def _stage_peak(g: Graph, live: Live, computed: list, reads: list, keep: set, share: bool) -> int:
    """Highest live storage (plus workspace) at any computation of the stage."""
    last_read = {}
    for pos, inputs in enumerate(reads):
        for x in inputs:
            last_read[x] = pos
    for pos, x in enumerate(computed):
        last_read.setdefault(x, pos)
    holding = {x for x in live if x in keep or x in last_read}
    peak = 0
    for pos, x in enumerate(computed):
        holding.add(x)
        keys = set().union(*(h[2] for h in holding))
        taken = _taken_over(g, x, reads[pos], holding, keep, last_read, pos) if share else set()
        peak = max(peak, sum(int(g.unit_size[u]) for _, u in keys - taken) + int(g.workspace[x[0]]))
        holding -= {h for h in holding if h not in keep and last_read[h] == pos}
    return peak


def _taken_over(g: Graph, x: tuple, inputs: list, holding: set, keep: set, last_read: dict, pos: int) -> set:
    """The storage keys computation x writes over instead of allocating its own (none
    when some other holder still needs them)."""
    source = int(g.shareable[x[0]])
    if source < 0:
        return set()
    (read,) = [h for h in inputs if h[0] == source]
    if any(h[2] & read[2] and (h in keep or last_read[h] != pos) for h in holding if h != x):
        return set()
    return set(x[2])
