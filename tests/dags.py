"""Random training-like DAGs for property tests, built through the public Graph API."""

from __future__ import annotations

from hypothesis import strategies as st

from optremat import Graph
from optremat.core.synthetic import training_chain

__all__ = ["graphs", "training_chain", "training_graphs"]


@st.composite
def graphs(draw: st.DrawFn, max_nodes: int = 12, shared_storage: bool = True, typed: bool = False) -> Graph:
    """A random DAG with params, outputs and, with `shared_storage`, plain aliases and
    multi-output parts; `typed` gives ops few sizes, tensor types and pointwise flags,
    so that many may write over an input (`Graph.shareable`)."""
    params = draw(st.integers(0, 2))
    ops = draw(st.integers(1, max_nodes))
    n = params + ops
    edges: set[tuple[int, int]] = set()
    alias_of = [-1] * n
    size = [draw(st.integers(1, 64)) for _ in range(params)]
    for v in range(params, n):
        preds = draw(st.sets(st.integers(0, v - 1), min_size=int(typed), max_size=3)) if v > 0 else set()
        edges.update((p, v) for p in preds)
        size.append(draw(st.sampled_from([8, 8, 16]) if typed else st.integers(0, 64)))
        candidates = sorted(p for p in preds if alias_of[p] < 0 and p >= params)
        if shared_storage and candidates and draw(st.integers(0, 3)) == 0:
            base = draw(st.sampled_from(candidates))
            alias_of[v] = base
            room = size[base] - sum(size[i] for i in range(params, v) if alias_of[i] == base)
            part = draw(st.booleans()) and room > 0
            size[v] = draw(st.integers(1, room)) if part else 0
    cost = [0.0] * params + [float(draw(st.integers(1, 9))) for _ in range(ops)]
    output = [False] * params + [draw(st.integers(0, 4)) == 0 for _ in range(ops)]
    workspace = [0] * params + [draw(st.sampled_from([0, 0, 0, 8])) for _ in range(ops)]
    fusible = [False] * params + [typed and draw(st.integers(0, 3)) > 0 for _ in range(ops)]
    return Graph.build(cost=cost, size=size, edges=edges, alias_of=alias_of, output=output,
                       kind=["param"] * params + ["op"] * ops, workspace=workspace, fusible=fusible,
                       tensor=[f"f32[{s}]" if typed else "" for s in size])


@st.composite
def training_graphs(draw: st.DrawFn, max_layers: int = 8, unsaved_inputs: bool = False) -> Graph:
    """A random training graph: an input, forward ops reading one or two earlier tensors,
    a loss, and per forward op a gradient op reading the gradients of its readers, its
    inputs and, at times, its own output (as ReLU's backward does). With
    `unsaved_inputs`, a gradient op may skip some of its op's inputs (as an add's does),
    so that some tensors are read in the forward pass alone."""
    layers = draw(st.integers(1, max_layers))
    forward_preds = [[0]]
    for i in range(2, layers + 1):
        forward_preds.append(sorted({i - 1} | draw(st.sets(st.integers(0, i - 1), max_size=1))))
    readers: list[list[int]] = [[] for _ in range(layers + 2)]
    for i, preds in enumerate(forward_preds, start=1):
        for p in preds:
            readers[p].append(i)
    loss = layers + 1
    readers[layers].append(loss)
    edges = [(p, i) for i, preds in enumerate(forward_preds, start=1) for p in preds] + [(layers, loss)]
    gradient = {loss: loss}
    for i in range(layers, 0, -1):
        g = loss + 1 + (layers - i)
        gradient[i] = g
        saved = [p for p in forward_preds[i - 1] if not unsaved_inputs or draw(st.booleans())]
        reads = {gradient[r] for r in readers[i]} | set(saved)
        if draw(st.booleans()):
            reads.add(i)
        edges += [(r, g) for r in reads]
    n = 2 * layers + 2
    size = [draw(st.integers(1, 16)) for _ in range(layers + 1)] + [1]
    size += [size[i] for i in range(layers, 0, -1)]
    cost = [0.0] + [float(draw(st.integers(1, 9))) for _ in range(layers)] + [1.0]
    cost += [2 * cost[i] for i in range(layers, 0, -1)]
    return Graph.build(cost=cost, size=size, edges=sorted(set(edges)), kind=["input"] + ["op"] * (n - 1),
                       output=[False] * (n - 1) + [True], backward=[False] * (layers + 2) + [True] * layers,
                       workspace=[0] + [draw(st.sampled_from([0, 0, 4])) for _ in range(n - 1)])
