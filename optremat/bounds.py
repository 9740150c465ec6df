"""A lower bound on the recomputation any plan needs under a budget, from memory alone.

At the instant node t is computed in its own stage, every storage unit whose owner ran
before t and that some node after t still reads is either live or must be computed again
after t; the units t reads or writes, the parameters and inputs, and the outputs made so
far are live for certain. Where those bytes (with t's workspace) exceed the budget, the
units left out must be recomputed, each at the cost of the op that computes it. The
cheapest cover, relaxed to fractions (an op's cost spread over its units by bytes, so
dropping some of an op's units is never priced above the op), bounds every schedule's
extra cost, and so does the largest over all t. Solvers use it where their own bound is
weaker: CP-SAT's proves little on graphs of a few hundred nodes.
"""

from __future__ import annotations

import numpy as np

from optremat.graph import Graph


def recompute_lower_bound(graph: Graph, budget: int) -> float:
    """Least extra cost (beyond one computation of every node) of any schedule whose peak
    is at most `budget` bytes; `inf` when some instant cannot fit at all."""
    units = np.nonzero(graph.unit_size > 0)[0]
    if not len(units):
        return 0.0
    size = graph.unit_size[units].astype(np.float64)
    op = np.where(graph.is_part[units], graph.alias_of[units], units)
    op_bytes = np.bincount(op, weights=size, minlength=graph.n)
    ratio = graph.cost[op] / op_bytes[op]
    position = {int(u): k for k, u in enumerate(units)}
    last = op.copy()
    made_output = np.full(len(units), graph.n)
    for h in range(graph.n):
        read_until = max(graph.succs[h].tolist(), default=h)
        for u in graph.units[h]:
            k = position.get(u)
            if k is not None:
                last[k] = max(last[k], read_until)
                if graph.output[h]:
                    made_output[k] = min(made_output[k], h)
    resident = graph.pinned[op]
    order = np.argsort(ratio, kind="stable")
    size, op, ratio, last, made_output, resident = (a[order] for a in (size, op, ratio, last, made_output, resident))
    position = {int(units[order[k]]): k for k in range(len(units))}
    best = 0.0
    for t in np.nonzero(~graph.pinned)[0].tolist():
        must = resident | (made_output <= t)
        for h in graph.preds[t].tolist() + [t]:
            for u in graph.units[h]:
                if u in position:
                    must[position[u]] = True
        crossing = (op < t) & (last > t) & ~must
        excess = float(size[must & (op <= t)].sum() + size[crossing].sum()) + float(graph.workspace[t]) - budget
        if excess <= 0:
            continue
        freed = np.cumsum(size[crossing])
        if not len(freed) or freed[-1] < excess:
            return float("inf")
        whole = int(np.searchsorted(freed, excess))
        costs = (ratio * size)[crossing]
        partial = (excess - (freed[whole - 1] if whole else 0.0)) * ratio[crossing][whole]
        best = max(best, float(costs[:whole].sum()) + partial)
    return best


def tighten(graph: Graph, budget: int, cost: float, lower_bound: float, optimal: bool) -> tuple[float, bool]:
    """A solver's (lower bound, optimal) on total cost, raised by `recompute_lower_bound`:
    a plan whose cost meets the raised bound is optimal whatever the solver proved."""
    bound = max(lower_bound, graph.total_cost + recompute_lower_bound(graph, budget))
    return bound, optimal or cost <= bound + 1e-9 * graph.total_cost
