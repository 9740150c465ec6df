"""Execution order: a reordered graph is the same step, and best_order never raises the peak."""

import numpy as np
from hypothesis import given, settings

import optremat
from optremat import keep_all, simulate
from optremat.core.order import best_order, min_memory_order, reorder, sunk_views
from optremat.core.schedule import from_kept
from optremat.models import build
from tests.dags import graphs


@settings(max_examples=150)
@given(graphs())
def test_min_memory_order_is_the_same_step_and_best_order_never_raises_the_peak(g):
    order = min_memory_order(g)
    moved = reorder(g, order)
    assert sorted(order.tolist()) == list(range(g.n))
    assert [moved.names[k] for k in range(g.n)] == [g.names[i] for i in order.tolist()]
    edges = {(g.names[a], g.names[b]) for a, b in g.edges.tolist()}
    assert {(moved.names[a], moved.names[b]) for a, b in moved.edges.tolist()} == edges
    assert np.isclose(moved.total_cost, g.total_cost)
    best, used = best_order(g)
    assert simulate(best, keep_all(best)).peak_bytes <= simulate(g, keep_all(g)).peak_bytes
    assert [best.names[k] for k in range(g.n)] == [g.names[i] for i in used.tolist()]


def test_in_place_ops_stay_after_the_readers_of_what_they_overwrite():
    example = build("resnet-tiny")
    g = optremat.extract(example.model, example.inputs, example.loss_fn)
    position = np.empty(g.n, dtype=np.int64)
    position[min_memory_order(g)] = np.arange(g.n)
    root = np.arange(g.n)
    for v in range(g.n):
        if g.alias_of[v] >= 0:
            root[v] = root[g.alias_of[v]]
    in_place = [v for v in range(g.n) if g.alias_of[v] >= 0 and g.ops[v].split(".")[0].endswith("_")]
    assert in_place, "resnet-tiny's BatchNorm statistics are updated in place"
    for v in in_place:
        for u in range(v):
            if any(root[p] == root[v] for p in g.preds[u].tolist()):
                assert position[u] < position[v]


def test_reordering_lowers_a_built_in_models_unplanned_peak():
    example = build("vgg-tiny")
    g = optremat.extract(example.model, example.inputs, example.loss_fn)
    best, used = best_order(g)
    assert simulate(best, keep_all(best)).peak_bytes < 0.9 * simulate(g, keep_all(g)).peak_bytes
    assert not np.array_equal(used, np.arange(g.n))


def joint_with_an_early_detach() -> optremat.Graph:
    """x -> a (forward, 64 bytes) -> out -> loss; then the backward: a detach of `a` right
    after the loss (where AOTAutograd's joint graph puts the detach of a saved output), a
    32-byte gradient g1 read only by g2, and g_a, which reads g2 and the detach."""
    names = ["x", "a", "out", "loss", "detach", "g1", "g2", "g_a"]
    edges = [(0, 1), (1, 2), (2, 3), (1, 4), (3, 5), (5, 6), (4, 7), (6, 7)]
    return optremat.Graph.build(cost=[0.0, 4.0, 1.0, 1.0, 0.0, 1.0, 1.0, 2.0], size=[8, 64, 8, 1, 0, 32, 8, 8],
                                edges=edges, names=names, kind=["input"] + ["op"] * 7,
                                ops=["input", "mm", "sum", "loss", "detach", "ones", "mul", "mm"],
                                alias_of=[-1, -1, -1, -1, 1, -1, -1, -1], backward=[False] * 3 + [True] * 5,
                                output=[False] * 7 + [True])


def test_a_backward_view_runs_when_read_so_a_recomputation_waits_for_it():
    g = joint_with_an_early_detach()
    sunk = sunk_views(g)
    assert list(sunk.names) == ["x", "a", "out", "loss", "g1", "g2", "detach", "g_a"]
    kept = np.ones(g.n, dtype=bool)
    kept[1] = False
    early = simulate(g, from_kept(g, kept, reuse=True))
    late = simulate(sunk, from_kept(sunk, kept[[g.names.index(name) for name in sunk.names]], reuse=True))
    # recomputed for the early detach, a (64) lives through g2's allocation (8) beside x (8) and g1
    # (32); sunk, it is recomputed after g1 has died, beside x, g2 and g_a (8 each)
    assert (early.peak_bytes, late.peak_bytes) == (8 + 64 + 32 + 8, 8 + 8 + 64 + 8)
    assert sunk_views(sunk) is sunk


@settings(max_examples=100)
@given(graphs())
def test_sinking_views_is_the_same_step_and_never_raises_the_peak(g):
    sunk = sunk_views(g)
    index = {name: k for k, name in enumerate(sunk.names)}
    assert sorted(sunk.names) == sorted(g.names)
    assert {(sunk.names[a], sunk.names[b]) for a, b in sunk.edges.tolist()} == {
        (g.names[a], g.names[b]) for a, b in g.edges.tolist()}
    assert simulate(sunk, keep_all(sunk)).peak_bytes <= simulate(g, keep_all(g)).peak_bytes
    for v in range(g.n):
        if index[g.names[v]] != v:
            assert g.backward[v] and g.alias_of[v] >= 0 and g.size[v] == 0
