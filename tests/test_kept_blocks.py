"""Keep sets of a compiled step's alike blocks, solved on one block and composed
(`optremat.ilp.kept_blocks`); `compile_backend` runs them in tests/test_compile.py."""

from __future__ import annotations

from itertools import product

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optremat import Graph
from optremat.core.schedule import from_kept, simulate
from optremat.ilp.kept_blocks import MIN_BLOCKS, Blocks, Option, _levels, block_options, compose, find_blocks

# one block: (op, cost, size factor, inputs as offsets into the block, -1 the block's input)
BLOCK = [("norm", 1.0, 1, [-1]), ("mm", 8.0, 2, [0]), ("act", 1.0, 2, [1]), ("mm", 8.0, 1, [2]),
         ("add", 1.0, 1, [-1, 3])]


def block_chain(blocks: int, sizes: list[int] | None = None, random_at: int | None = None) -> Graph:
    """An input, `blocks` blocks of BLOCK under modules `layers.<i>` (block i's tensors
    `sizes[i]` bytes a unit, 64 by default), a loss, and a backward op per forward op
    reading that op's inputs and the gradient before it; op `random_at` of every block
    is a dropout."""
    sizes = sizes or [64] * blocks
    names, ops, cost, size, module, edges, backward = ["x"], ["input"], [0.0], [64], [""], [], [False]
    forward: list[tuple[int, list[int]]] = []
    exit_ = 0
    for b in range(blocks):
        first = len(names)
        for p, (op, c, factor, reads) in enumerate(BLOCK):
            preds = [exit_ if r < 0 else first + r for r in reads]
            names.append(f"l{b}_{p}")
            ops.append("dropout" if p == random_at else op)
            cost.append(c)
            size.append(factor * sizes[b])
            module.append(f"layers.{b}")
            backward.append(False)
            edges += [(q, len(names) - 1) for q in preds]
            forward.append((len(names) - 1, preds))
        exit_ = len(names) - 1
    names.append("loss")
    ops.append("loss")
    cost.append(1.0)
    size.append(4)
    module.append("")
    backward.append(False)
    edges.append((exit_, len(names) - 1))
    gradient = len(names) - 1
    for v, preds in reversed(forward):
        names.append(f"grad_{names[v]}")
        ops.append("grad")
        cost.append(2 * cost[v])
        size.append(size[v])
        module.append("")
        backward.append(True)
        edges += [(gradient, len(names) - 1)] + [(q, len(names) - 1) for q in preds]
        gradient = len(names) - 1
    n = len(names)
    return Graph.build(names=names, ops=ops, cost=cost, size=size, module=module, edges=sorted(set(edges)),
                       kind=["input"] + ["op"] * (n - 1), backward=backward, output=[False] * (n - 1) + [True])


def test_the_blocks_are_found_in_order_position_by_position() -> None:
    graph = block_chain(6)
    blocks = find_blocks(graph)
    assert blocks is not None and blocks.prefix == "layers"
    assert blocks.nodes.shape == (6, len(BLOCK))
    assert [graph.module[int(v)] for v in blocks.nodes[:, 0]] == [f"layers.{b}" for b in range(6)]
    assert all(graph.ops[int(v)] == graph.ops[int(w)] for v, w in zip(blocks.nodes[0], blocks.nodes[-1]))


def test_a_block_unlike_the_others_ends_the_chain_and_too_few_make_none() -> None:
    graph = block_chain(9, sizes=[64] * 3 + [128] + [64] * 5)
    blocks = find_blocks(graph)
    assert blocks is not None
    assert [graph.module[int(v)] for v in blocks.nodes[:, 0]] == [f"layers.{b}" for b in range(4, 9)]
    assert find_blocks(block_chain(MIN_BLOCKS - 1)) is None
    assert find_blocks(block_chain(8, sizes=[64, 128] * 4)) is None


def brute_force_least_recompute(graph: Graph, blocks: Blocks, once: np.ndarray, cap: int) -> float | None:
    """The least recompute of any keep set of the middle block that keeps at most `cap`
    bytes, by every mask: the backward's reads and what they need computed again, the
    block's output kept, the ops in `once` never recomputed."""
    nodes = blocks.nodes[len(blocks.nodes) // 2].tolist()
    inside = set(nodes)
    best = None
    for mask in product([False, True], repeat=len(nodes)):
        kept = {v for v, k in zip(nodes, mask) if k}
        if any(v not in kept and any(u not in inside and not graph.backward[u] for u in graph.succs[v].tolist())
               for v in nodes):
            continue
        needed = [v for v in nodes if graph.backward[graph.succs[v]].any() and v not in kept]
        recomputed = set()
        while needed:
            v = needed.pop()
            if v not in recomputed:
                recomputed.add(v)
                needed += [u for u in graph.preds[v].tolist() if u in inside and u not in kept]
        if any(once[v] for v in recomputed) or sum(int(graph.size[v]) for v in kept) > cap:
            continue
        cost = sum(float(graph.cost[v]) for v in recomputed)
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("random_at", [None, 2])
def test_each_option_recomputes_the_least_any_keep_set_of_its_bytes_does(random_at: int | None) -> None:
    graph = block_chain(5, random_at=random_at)
    blocks = find_blocks(graph)
    once = np.array([op == "dropout" for op in graph.ops])
    options = block_options(graph, blocks, once)
    assert len(options) >= 3
    assert [o.bytes for o in options] == sorted((o.bytes for o in options), reverse=True)
    nodes = blocks.nodes[2]
    for option in options:
        recomputed = _recomputed(graph, nodes, option)
        assert sum(graph.cost[v] for v in recomputed) == brute_force_least_recompute(graph, blocks, once, option.bytes)
        assert not any(once[v] for v in recomputed)


def _recomputed(graph: Graph, nodes: np.ndarray, option: Option) -> set[int]:
    kept = {int(v) for v, k in zip(nodes, option.kept) if k}
    inside = set(nodes.tolist())
    needed = [int(v) for v in nodes if graph.backward[graph.succs[v]].any() and int(v) not in kept]
    recomputed: set[int] = set()
    while needed:
        v = needed.pop()
        if v not in recomputed:
            recomputed.add(v)
            needed += [u for u in graph.preds[v].tolist() if u in inside and u not in kept]
    return recomputed


def _simulated(graph: Graph, kept: np.ndarray):
    return simulate(graph, from_kept(graph, kept, reuse=True))


@settings(max_examples=25, deadline=None)
@given(fraction=st.floats(0.3, 1.0))
def test_a_composed_keep_set_fits_its_budget_or_none_of_the_least_does(fraction: float) -> None:
    graph = block_chain(6)
    blocks = find_blocks(graph)
    options = block_options(graph, blocks, np.zeros(graph.n, dtype=bool))
    base = np.ones(graph.n, dtype=bool)
    budget = int(_simulated(graph, base).peak_bytes * fraction)
    kept = compose(blocks, options, base, budget, lambda k: _simulated(graph, k).peak_bytes)
    least = base.copy()
    for nodes in blocks.nodes:
        least[nodes] = options[-1].kept
    if _simulated(graph, least).peak_bytes > budget:
        assert kept is None
    else:
        assert kept is not None and _simulated(graph, kept).peak_bytes <= budget
        assert _simulated(graph, kept).cost <= _simulated(graph, least).cost


@settings(max_examples=25, deadline=None)
@given(fraction=st.floats(0.0, 1.0), count=st.integers(MIN_BLOCKS, 9))
def test_composition_finds_the_cheapest_level_when_peaks_grow_as_the_bytes_kept(fraction: float, count: int) -> None:
    """Where a level's peak grows in proportion to the bytes the blocks keep, as the line
    through two priced levels assumes, the levels priced close on the cheapest that fits."""
    sizes = [96, 64, 40, 16, 0]
    options = [Option(np.arange(4) < 4 - i, s) for i, s in enumerate(sizes)]
    blocks = Blocks("layers", np.arange(4 * count).reshape(count, 4))
    levels = _levels(sizes, count)

    def peak(kept: np.ndarray) -> int:
        return 1000 + sum(options[next(i for i, o in enumerate(options) if (o.kept == row).all())].bytes
                          for row in kept[blocks.nodes])

    budget = 1000 + int(fraction * levels[-1][0])
    kept = compose(blocks, options, np.zeros(4 * count, dtype=bool), budget, peak)
    assert peak(kept) == 1000 + max(k for k, _, _ in levels if 1000 + k <= budget)
