"""Optimal checkpointing of a training chain by dynamic programming (after Griewank's
revolve and Rotor's heterogeneous-chain DP, Herrmann et al. 2019).

A training chain is input → f_1 … f_L → loss → b_L … b_1, where b_i reads the gradient
from b_(i+1) (the loss for b_L) and f_(i-1), the input of layer i. The first forward
sweep may keep any of the f's; in the backward, reaching b_i from the nearest kept
f_a means recomputing f_(a+1) … and keeping some of them on the way (nested
recomputation). The DP prices every peak exactly as `simulate` does (each computation
allocates while its inputs live), so it is optimal among persistent nested schedules
(a kept f stays until its last use), Rotor's class. On uniform chains that is optimal
outright (the tests check it against the exact solvers at every budget); on
heterogeneous chains the exact solvers sometimes do a few percent better by dropping a
checkpoint after the advance that used it and recomputing it cheaply later.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from optremat.budget import InfeasibleBudget
from optremat.graph import Graph
from optremat.schedule import Schedule, from_computations, simulate


class NotAChain(ValueError):
    """The graph is not a training chain, so the chain DP does not apply."""


@dataclass(frozen=True)
class Chain:
    """The node ids of a training chain: f[0] is the input (or -1), f[1..L], loss, b[1..L]."""

    f: tuple[int, ...]
    loss: int
    b: tuple[int, ...]


def as_chain(graph: Graph) -> Chain | None:
    """The chain structure of `graph`, or None when it is not a training chain."""
    ops = np.nonzero(~graph.pinned)[0].tolist()
    if len(ops) < 3 or len(ops) % 2 == 0 or (graph.alias_of >= 0).any():
        return None
    layers = (len(ops) - 1) // 2
    f = tuple([-1] + ops[:layers])
    loss = ops[layers]
    b = tuple([-1] + ops[:layers:-1])
    reads = {v: set(graph.preds[v].tolist()) - set(np.nonzero(graph.pinned)[0].tolist()) for v in ops}
    expected = {f[k]: {f[k - 1]} - {-1} for k in range(1, layers + 1)}
    expected[loss] = {f[layers]}
    for i in range(1, layers + 1):
        expected[b[i]] = {b[i + 1] if i < layers else loss} | ({f[i - 1]} - {-1})
    outputs = set(np.nonzero(graph.output)[0].tolist())
    if reads != expected or not outputs <= {b[1]}:
        return None
    return Chain(f, loss, b)


def chain_dp(graph: Graph, budget: int) -> Schedule:
    """The cheapest nested checkpointing schedule of a training chain within `budget`.

    Raises NotAChain for a graph that is not a training chain (`as_chain`) and
    InfeasibleBudget, naming the smallest budget a nested schedule fits, otherwise.
    """
    chain = as_chain(graph)
    if chain is None:
        raise NotAChain("dp plans training chains (input → f_1..f_L → loss → b_L..b_1); use cpsat for other graphs")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20 * len(chain.f) + 1000))
    try:
        sweep, backward = _tables(graph, chain, budget)
        if sweep(0, graph.pinned_bytes)[0] == math.inf:
            lo, hi = budget + 1, simulate(graph, from_computations(graph, [])).peak_bytes
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if _tables(graph, chain, mid)[0](0, graph.pinned_bytes)[0] < math.inf else (mid + 1, hi)
            raise InfeasibleBudget(budget, lo, "dp", proven=False)
        computations: list[tuple[int, int]] = []
        _unfold_sweep(sweep, backward, chain, graph, computations)
    finally:
        sys.setrecursionlimit(limit)
    return from_computations(graph, computations)


def _sizes(graph: Graph, chain: Chain) -> list[int]:
    return [0] + [int(graph.size[v]) for v in chain.f[1:]]


def _tables(graph: Graph, chain: Chain, budget: int):
    """The DP's two memoised recurrences for one budget."""
    layers = len(chain.f) - 1
    size = _sizes(graph, chain)
    cost = [0.0] + [float(graph.cost[v]) for v in chain.f[1:]]
    work = [0] + [int(graph.workspace[v]) for v in chain.f[1:]]
    grad = [0] + [int(graph.size[v]) for v in chain.b[1:]] + [int(graph.size[chain.loss])]
    grad_work = [0] + [int(graph.workspace[v]) for v in chain.b[1:]]
    loss_work = int(graph.workspace[chain.loss])

    def advance_fits(a: int, j: int, fixed: int) -> bool:
        """Recomputing f_(a+1)..f_j from kept f_a while `fixed` bytes are live."""
        return all(fixed + (size[k - 1] if k - 1 > a else 0) + size[k] + work[k] <= budget for k in range(a + 1, j + 1))

    @lru_cache(maxsize=None)
    def backward(a: int, b: int, fixed: int) -> tuple[float, int]:
        """(least extra cost, best first checkpoint j or 0) to run b_b..b_(a+1) with f_a
        kept (its bytes in `fixed`) and b_b's incoming gradient live."""
        live = fixed + grad[b + 1]
        if b == a + 1:
            return (0.0, 0) if live + grad[b] + grad_work[b] <= budget else (math.inf, 0)
        best = (math.inf, 0)
        recompute = 0.0
        for j in range(a + 1, b):
            recompute += cost[j]
            if not advance_fits(a, j, live):
                break
            upper = backward(j, b, fixed + size[j])[0]
            if upper < math.inf:
                best = min(best, (recompute + upper + backward(a, j, fixed)[0], j))
        return best

    @lru_cache(maxsize=None)
    def sweep(a: int, fixed: int) -> tuple[float, int]:
        """(least extra cost, next kept f_j or 0) for the rest of the first forward sweep
        from kept f_a, then the whole backward below it."""
        best = (math.inf, 0)
        if advance_fits(a, layers, fixed) and fixed + size[layers] + grad[layers + 1] + loss_work <= budget:
            best = (backward(a, layers, fixed)[0], 0)
        for j in range(a + 1, layers):
            if not advance_fits(a, j, fixed):
                break
            rest = sweep(j, fixed + size[j])[0]
            if rest < math.inf:
                best = min(best, (rest + backward(a, j, fixed)[0], j))
        return best

    return sweep, backward


def _unfold_sweep(sweep, backward, chain: Chain, graph: Graph, out: list) -> None:
    size = _sizes(graph, chain)
    fixed = graph.pinned_bytes
    a = 0
    pending = []
    while True:
        _, j = sweep(a, fixed)
        if j == 0:
            pending.append((a, len(chain.f) - 1, fixed))
            break
        pending.append((a, j, fixed))
        fixed += size[j]
        a = j
    for a, b, fixed in reversed(pending):
        _unfold_backward(backward, chain, size, a, b, fixed, out)


def _unfold_backward(backward, chain: Chain, size: list[int], a: int, b: int, fixed: int, out: list) -> None:
    """Append the recomputations of backward(a, b, fixed): each advance runs in the stage
    of the backward node that first needs it."""
    if b == a + 1:
        return
    _, j = backward(a, b, fixed)
    out.extend((chain.f[k], chain.b[b]) for k in range(a + 1, j + 1))
    _unfold_backward(backward, chain, size, j, b, fixed + size[j], out)
    _unfold_backward(backward, chain, size, a, j, fixed, out)
