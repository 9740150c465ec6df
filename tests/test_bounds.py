import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optremat import Graph, keep_all, simulate
from optremat.core.schedule import peak_floor
from optremat.ilp.bounds import recompute_lower_bound
from tests.bruteforce import optimum
from tests.dags import graphs, training_chain, training_graphs


@settings(max_examples=300)
@given(graphs(max_nodes=8), st.floats(0.2, 1.0))
def test_the_bound_never_exceeds_the_optimum(g, fraction):
    budget = int(simulate(g, keep_all(g)).peak_bytes * fraction)
    bound = recompute_lower_bound(g, budget)
    best = optimum(g, budget)
    assert bound >= 0
    if best is not None:
        assert bound <= best[0] - g.total_cost + 1e-9


def test_the_bound_is_zero_when_everything_fits_and_grows_as_the_budget_shrinks():
    chain = training_chain([1.0] * 10, [8] * 10)
    peak = simulate(chain, keep_all(chain)).peak_bytes
    assert recompute_lower_bound(chain, peak) == 0.0
    bounds = [recompute_lower_bound(chain, int(peak * f)) for f in (0.9, 0.7, 0.5)]
    assert 0 < bounds[0] < bounds[1] < bounds[2] < float("inf")


def test_an_instant_that_cannot_fit_gives_an_infinite_bound():
    chain = training_chain([1.0] * 4, [8] * 4)
    assert recompute_lower_bound(chain, 8) == float("inf")
    assert optimum(chain, 8) is None


def test_a_tensor_dropped_between_two_pairs_of_its_uses_is_paid_for_twice():
    g = Graph.build(cost=[1.0, 100.0, 100.0, 100.0, 100.0, 100.0, 100.0], size=[10, 10, 0, 0, 10, 0, 0],
                    edges=[(1, 2), (0, 3), (4, 5), (0, 6)], output=[False, False, True, True, False, True, True])
    assert recompute_lower_bound(g, 10) == pytest.approx(2.0, rel=1e-5)
    assert optimum(g, 10)[0] - g.total_cost == pytest.approx(2.0)


def test_a_costly_tensor_is_never_half_dropped():
    g = Graph.build(cost=[10.0, 8.0, 1.0, 1.0, 1.0], size=[20, 10, 10, 0, 0], edges=[(2, 3), (0, 4), (1, 4)],
                    output=[False, False, False, True, True])
    assert recompute_lower_bound(g, 30) == pytest.approx(8.0, rel=1e-5)
    assert optimum(g, 30)[0] - g.total_cost == pytest.approx(8.0)


@settings(max_examples=150)
@given(training_graphs(max_layers=3, unsaved_inputs=True), st.floats(0.3, 1.0))
def test_the_bound_never_exceeds_the_optimum_of_a_training_step(g, fraction):
    budget = int(simulate(g, keep_all(g)).peak_bytes * fraction)
    best = optimum(g, budget)
    if best is not None:
        assert recompute_lower_bound(g, budget) <= best[0] - g.total_cost + 1e-9


def test_recomputing_a_tensor_pays_for_the_inputs_nothing_else_kept():
    # s = a + p is dropped across the peak (node 3) and recomputed for node 5, but a and
    # p have no reader after s: keeping them across the peak does not fit either, so both
    # are computed again as well (1 + 10 + 1)
    g = Graph.build(cost=[1.0, 10.0, 1.0, 1.0, 1.0, 1.0], size=[10, 10, 10, 30, 1, 1],
                    edges=[(0, 1), (0, 2), (1, 2), (3, 4), (2, 5)], output=[False] * 4 + [True, True])
    assert recompute_lower_bound(g, 35) == pytest.approx(12.0, rel=1e-5)
    assert optimum(g, 35)[0] - g.total_cost == pytest.approx(12.0)


@settings(max_examples=200)
@given(st.lists(st.integers(1, 30), min_size=6, max_size=6), st.lists(st.integers(1, 9), min_size=6, max_size=6),
       st.floats(0.3, 1.0), st.booleans())
def test_the_bound_with_inputs_held_for_recomputation_never_exceeds_the_optimum(size, cost, fraction, saved):
    edges = [(0, 1), (0, 2), (1, 2), (3, 4), (2, 5)] + ([(0, 5)] if saved else [])
    g = Graph.build(cost=[float(c) for c in cost], size=size, edges=edges, output=[False] * 4 + [True, True])
    budget = int(simulate(g, keep_all(g)).peak_bytes * fraction)
    best = optimum(g, budget)
    if best is not None:
        assert recompute_lower_bound(g, budget) <= best[0] - g.total_cost + 1e-9


@settings(max_examples=150)
@given(graphs(max_nodes=8))
def test_no_schedule_fits_under_the_peak_floor(g):
    floor = peak_floor(g)
    assert floor <= simulate(g, keep_all(g)).peak_bytes
    assert optimum(g, floor - 1) is None


@settings(max_examples=50)
@given(training_graphs(max_layers=3, unsaved_inputs=True))
def test_no_schedule_of_a_training_step_fits_under_the_peak_floor(g):
    floor = peak_floor(g)
    assert optimum(g, floor - 1) is None
    assert floor >= int(g.size[g.pinned | g.output].sum())
