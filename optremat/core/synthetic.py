"""Synthetic training graphs for tests and benchmarks: chains, where the optimal
schedules are known, and residual networks of any depth."""

from __future__ import annotations

import random

from optremat.core.graph import Graph


def training_chain(costs: list[float], sizes: list[int]) -> Graph:
    """A chain of layers and its backward: input, f_1..f_L, the loss, then b_L..b_1 where
    b_i reads f_i's input and the gradient from b_(i+1); the input's gradient is the output."""
    layers = len(costs)
    n = 2 * layers + 2
    edges = [(i, i + 1) for i in range(layers + 1)]
    for i in range(layers, 0, -1):
        b = 2 * layers + 2 - i
        edges += [(b - 1, b), (i - 1, b)]
    return Graph.build(cost=[0.0] + list(costs) + [0.0] + [2.0 * c for c in reversed(costs)],
                       size=[sizes[0]] + list(sizes) + [1] + [sizes[i - 1] for i in range(layers, 0, -1)],
                       edges=sorted(set(edges)), kind=["input"] + ["op"] * (n - 1),
                       output=[False] * (n - 1) + [True], backward=[False] * (layers + 2) + [True] * layers)


def random_training_graph(layers: int, seed: int = 0) -> Graph:
    """A residual training graph: `layers` forward ops (some with skip inputs), a loss,
    and a backward op per layer reading the layer's input and the incoming gradient."""
    rng = random.Random(seed)
    edges, cost, size = [], [], []
    for i in range(layers):
        cost.append(rng.uniform(1, 10))
        size.append(rng.randint(1, 16) * 1024)
        if i:
            edges.append((i - 1, i))
        if i > 4 and rng.random() < 0.2:
            edges.append((i - rng.randint(2, 4), i))
    loss = layers
    cost.append(1.0)
    size.append(8)
    edges.append((layers - 1, loss))
    for k, i in enumerate(range(layers - 1, -1, -1)):
        b = loss + 1 + k
        cost.append(2 * cost[i])
        size.append(size[i])
        edges += [(b - 1, b)] + ([(i - 1, b)] if i else [])
    n = 2 * layers + 1
    return Graph.build(cost=cost, size=size, edges=sorted(set(edges)), backward=[False] * (layers + 1) + [True] * layers,
                       output=[False] * (n - 1) + [True])
