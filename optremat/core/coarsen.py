"""Coarsening (after MXNet's op bulking): fuse cheap ops into groups the solvers see as one node.

Views and pointwise ops whose inputs all come from one group (parameters aside) join
that group, so a
matmul and its bias-add, reshape and activation become one node; optionally, consecutive
ops of one module are grouped too. Parameters and inputs collapse into one resident
node. A plan on the coarse graph maps back to every original op with `expand`.

Groups stay acyclic because a node joins a group only when every input from outside the
group was computed before the group's first member.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from optremat.core.graph import Graph
from optremat.core.schedule import Schedule


@dataclass(frozen=True, eq=False)
class Coarsened:
    """A coarse graph and the fine graph renumbered so that each group is contiguous.

    `group[i]` is the coarse node of fine node i; `original[i]` is fine node i's index in
    the graph that was coarsened.
    """

    fine: Graph
    coarse: Graph
    group: np.ndarray
    original: np.ndarray

    @cached_property
    def bounds(self) -> np.ndarray:
        """bounds[g], bounds[g+1]: the fine node range of coarse node g."""
        return np.searchsorted(self.group, np.arange(self.coarse.n + 1))

    @cached_property
    def escapes(self) -> np.ndarray:
        """Fine nodes read outside their group, or that must stay resident."""
        fine = self.fine
        src, dst = fine.edges[:, 0], fine.edges[:, 1]
        out = fine.pinned | fine.output
        out[src[self.group[src] != self.group[dst]]] = True
        return out

    def expand(self, schedule: Schedule) -> Schedule:
        """The fine schedule that runs `schedule` (on the coarse graph) op by op."""
        fine, bounds, group, escapes = self.fine, self.bounds, self.group, self.escapes
        resident = fine.pinned | fine.output
        events = []
        for g, t, u in schedule.events:
            for m in range(bounds[g], bounds[g + 1]):
                stage = m if t == g else int(bounds[t])
                if resident[m]:
                    until = fine.n - 1
                elif not escapes[m] or u == g:
                    inside = [int(c) for c in fine.succs[m] if group[c] == g]
                    until = max([stage] + inside) if t == g else stage
                else:
                    until = max([int(bounds[u])] + [int(c) for c in fine.succs[m] if group[c] == u])
                events.append((m, stage, until))
        return Schedule.from_events(events, fine.n)


def coarsen(graph: Graph, *, by_module: bool = False) -> Coarsened:
    """Group `graph`'s nodes; see the module docstring for the rules."""
    group = _assign_groups(graph, by_module)
    leaders = sorted(set(group.tolist()))
    rank = {leader: r for r, leader in enumerate(leaders)}
    coarse_of = np.array([rank[g] for g in group.tolist()], dtype=np.int64)
    original = np.array(sorted(range(graph.n), key=lambda i: (coarse_of[i], i)), dtype=np.int64)
    fine = _permute(graph, original)
    fine_group = coarse_of[original]
    fine_group.setflags(write=False)
    original.setflags(write=False)
    return Coarsened(fine=fine, coarse=_contract(fine, fine_group), group=fine_group, original=original)


def _assign_groups(graph: Graph, by_module: bool) -> np.ndarray:
    """group[i] = the lowest node index of i's group."""
    n = graph.n
    group = np.arange(n)
    for v in range(n):
        if graph.pinned[v]:
            group[v] = 0
            continue
        preds = graph.preds[v].tolist()
        target = _fusion_target(graph, group, v, preds)
        if target is None and by_module and v > 0 and graph.module[v] and graph.module[v] == graph.module[v - 1]:
            target = _joinable(graph, group, v, preds, int(group[v - 1]))
        if target is not None:
            group[v] = target
    _split_short_parts(graph, group)
    return group


def _split_short_parts(graph: Graph, group: np.ndarray) -> None:
    """Give a part its own group when its group would otherwise keep its bytes too long.

    One output of a multi-output op (batch norm's result) often dies in the forward
    while its siblings (saved statistics) live until the backward; sharing a node with
    them would keep it alive as long. A part no group member reads can leave safely.
    """
    last = np.arange(graph.n)
    for src, dst in graph.edges.tolist():
        last[src] = max(last[src], dst)
    last[graph.pinned | graph.output] = graph.n
    read_inside = np.zeros(graph.n, dtype=bool)
    for src, dst in graph.edges.tolist():
        read_inside[src] |= group[src] == group[dst]
    group_last: dict[int, int] = {}
    for v in range(graph.n):
        group_last[int(group[v])] = max(group_last.get(int(group[v]), -1), int(last[v]))
    for v in np.nonzero(graph.is_part & ~read_inside)[0].tolist():
        if group[v] != v and last[v] < group_last[int(group[v])]:
            group[v] = v


def _fusion_target(graph: Graph, group: np.ndarray, v: int, preds: list[int]) -> int | None:
    """The group a view or pointwise node folds into: the one all its inputs come from."""
    if not graph.fusible[v] or not preds or (graph.is_part[v] and graph.output[v]):
        return None
    sources = {int(group[p]) for p in preds if not graph.pinned[p]} or {0}
    if len(sources) != 1:
        return None
    target = sources.pop()
    return _joinable(graph, group, v, preds, target)


def _joinable(graph: Graph, group: np.ndarray, v: int, preds: list[int], target: int) -> int | None:
    """`target` if v may join it: acyclic, and a view or an op of the same direction
    (forward/backward); the resident group takes only forward views, so that nothing
    that reads the output's gradient runs before the forward is done."""
    view = graph.alias_of[v] >= 0 and graph.size[v] == 0
    if graph.pinned[target]:
        allowed = view and not graph.backward[v]
    else:
        allowed = view or graph.backward[target] == graph.backward[v]
    if not allowed or any(group[p] != target and p >= target and not graph.pinned[p] for p in preds):
        return None
    return target


def _permute(graph: Graph, order: np.ndarray) -> Graph:
    """`graph` with node `order[k]` renumbered k."""
    new_index = np.empty(graph.n, dtype=np.int64)
    new_index[order] = np.arange(graph.n)
    pick = lambda column: [column[i] for i in order.tolist()]  # noqa: E731
    alias, lives_to = graph.alias_of[order], graph.lives_to[order]
    return Graph.build(
        names=pick(graph.names), ops=pick(graph.ops), cost=graph.cost[order], size=graph.size[order],
        edges=new_index[graph.edges].tolist(), backward=graph.backward[order], kind=pick(graph.kind),
        module=pick(graph.module), alias_of=np.where(alias >= 0, new_index[np.maximum(alias, 0)], -1),
        output=graph.output[order], fusible=graph.fusible[order], workspace=graph.workspace[order],
        tensor=pick(graph.tensor), held=graph.held[order],
        lives_to=np.where(lives_to >= 0, new_index[np.maximum(lives_to, 0)], -1),
    )


def _contract(fine: Graph, group: np.ndarray) -> Graph:
    """One node per group: summed cost, the bytes that leave the group, the internal peak."""
    n_groups = int(group.max()) + 1 if fine.n else 0
    bounds = np.searchsorted(group, np.arange(n_groups + 1))
    src, dst = fine.edges[:, 0], fine.edges[:, 1]
    crossing = group[src] != group[dst]
    escapes = fine.pinned | fine.output
    escapes[src[crossing]] = True
    unit_group = group[np.where(fine.is_part, fine.alias_of, np.arange(fine.n))]
    edges = sorted(set(zip(group[src[crossing]].tolist(), group[dst[crossing]].tolist())))
    reads = {(a, b) for a, b in edges}
    columns: dict[str, list] = {k: [] for k in ("names", "ops", "cost", "size", "backward", "kind", "module",
                                                "alias_of", "output", "workspace", "tensor")}
    for g in range(n_groups):
        members = range(bounds[g], bounds[g + 1])
        leader = members[0]
        held = {u for m in members if escapes[m] for u in fine.units[m]}
        by_group: dict[int, int] = {}
        for u in held:
            by_group[int(unit_group[u])] = by_group.get(int(unit_group[u]), 0) + int(fine.unit_size[u])
        alias_of, size = -1, by_group.pop(g, 0)
        base_group = int(group[fine.alias_of[leader]])
        only = next(iter(by_group)) if len(by_group) == 1 and size == 0 else None
        if only is not None and (only, g) not in reads:
            size = by_group[only]
        elif only is not None and fine.is_part[leader] and only == base_group and columns["alias_of"][only] < 0:
            alias_of, size = only, by_group[only]
        elif only is not None:
            alias_of = only
        columns["names"].append(fine.names[leader])
        columns["ops"].append(fine.ops[leader] + (f"+{len(members) - 1}" if len(members) > 1 else ""))
        columns["cost"].append(float(fine.cost[bounds[g]:bounds[g + 1]].sum()))
        columns["size"].append(size)
        columns["backward"].append(bool(fine.backward[leader]))
        columns["kind"].append(fine.kind[leader])
        columns["module"].append(fine.module[leader])
        columns["alias_of"].append(alias_of)
        columns["output"].append(bool(fine.output[bounds[g]:bounds[g + 1]].any()))
        columns["workspace"].append(_internal_peak(fine, members, escapes, group))
        columns["tensor"].append(";".join(fine.tensor[m] for m in members if escapes[m]))
    return Graph.build(edges=edges, fusible=[False] * n_groups, **columns)


def _internal_peak(fine: Graph, members: range, escapes: np.ndarray, group: np.ndarray) -> int:
    """Most bytes of non-escaping temporaries (and op workspace, and what the runtime holds
    in the member's stage) live while the group runs."""
    escaping_units = {u for m in members if escapes[m] for u in fine.units[m]}
    last_use = {m: m for m in members}
    for m in members:
        for s in fine.succs[m].tolist():
            if group[s] == group[m]:
                last_use[m] = max(last_use[m], s)
    holders: dict[int, int] = {}
    live = peak = 0
    for m in members:
        for u in fine.units[m]:
            if u not in escaping_units:
                holders[u] = holders.get(u, 0) + 1
                live += int(fine.unit_size[u]) if holders[u] == 1 else 0
        peak = max(peak, live + int(fine.workspace[m]) + int(fine.held[m]))
        for p in fine.preds[m].tolist() + [m]:
            if last_use.get(p) != m:
                continue
            for u in fine.units[p]:
                if u not in escaping_units:
                    holders[u] -= 1
                    live -= int(fine.unit_size[u]) if holders[u] == 0 else 0
    return peak
