import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optremat import Graph, InfeasibleBudget, keep_all, simulate, solve
from optremat.heuristics import NotAChain
from optremat.heuristics.chen import cut_points
from optremat.heuristics.mirror import mirror_path
from optremat.planners.solve import HEURISTICS
from tests.dags import graphs, training_chain


@settings(max_examples=60)
@given(graphs(max_nodes=14), st.floats(0.2, 1.0), st.sampled_from(sorted(HEURISTICS)))
def test_every_heuristic_fits_its_budget_or_says_infeasible(g, fraction, name):
    before = g.to_json()
    budget = max(1, int(simulate(g, keep_all(g)).peak_bytes * fraction))
    try:
        schedule = HEURISTICS[name](g, budget)
    except NotAChain:
        assert name == "dp"
    except InfeasibleBudget as error:
        assert error.smallest > budget and error.planner
    else:
        assert simulate(g, schedule).peak_bytes <= budget
    assert g.to_json() == before


@pytest.mark.parametrize("name", sorted(HEURISTICS))
def test_heuristics_save_memory_on_a_training_chain(name):
    chain = training_chain([1.0] * 16, [8] * 16)
    unplanned = simulate(chain, keep_all(chain))
    solution = solve(chain, 0.6, solver=name)
    result = simulate(chain, solution.schedule)
    assert result.peak_bytes <= 0.6 * unplanned.peak_bytes + 1
    assert 0 < result.overhead < 1.5


def test_cut_points_skip_nodes_a_residual_edge_jumps_over():
    # 0 -> 1 -> 2 -> 3 with a skip 1 -> 3: node 2 is spanned, 1 and 3 are cuts
    g = Graph.build(cost=[1.0] * 5, size=[1] * 5, edges=[(0, 1), (1, 2), (2, 3), (1, 3), (3, 4)],
                    backward=[False] * 4 + [True], output=[False] * 4 + [True])
    assert cut_points(g).tolist() == [0, 1, 3]


def _fc_relu():
    # x (input), W (param) -> y = FC(x, W) -> r = relu(y) -> loss; backward reads x, W, r, not y
    return Graph.build(
        names=["x", "W", "fc", "relu", "loss", "grad_relu", "grad_W"],
        cost=[0, 0, 10.0, 1.0, 1.0, 1.0, 10.0], size=[8, 8, 8, 8, 1, 8, 8],
        edges=[(0, 2), (1, 2), (2, 3), (3, 4), (4, 5), (3, 5), (5, 6), (0, 6)],
        kind=["input", "param"] + ["op"] * 5, backward=[False] * 5 + [True] * 2,
        output=[False] * 6 + [True])


def test_mirroring_puts_a_fully_connected_op_whose_gradient_ignores_its_output_on_the_path():
    g = _fc_relu()
    path = mirror_path(g)
    assert path[2]  # fc's output is never stored: its backward needs x and W
    assert not path[3]  # relu would need fc's output (as large) back: no benefit


def test_mirroring_does_not_recompute_an_rnn_cell_that_would_keep_more_alive():
    # h_prev -> three gates (each as large as h) -> cell output h, read by the backward;
    # recomputing h in the backward would need all three gates stored instead of h
    g = Graph.build(
        names=["h_prev", "Wg", "g1", "g2", "g3", "h", "loss", "grad_h", "grad_g"],
        cost=[0, 0, 5.0, 5.0, 5.0, 1.0, 1.0, 1.0, 3.0], size=[8, 8, 8, 8, 8, 8, 1, 8, 8],
        edges=[(0, 2), (1, 2), (0, 3), (1, 3), (0, 4), (1, 4), (2, 5), (3, 5), (4, 5), (5, 6), (6, 7), (5, 7),
               (7, 8), (0, 8)],
        kind=["input", "param"] + ["op"] * 7, backward=[False] * 7 + [True] * 2, output=[False] * 8 + [True])
    path = mirror_path(g)
    assert path[2] and path[3] and path[4]  # gates: no backward reader
    assert not path[5]
    cheap_cell = mirror_path(g, max_cost=0.5)
    assert not cheap_cell[5]


def test_mirroring_recomputes_a_cheap_op_whose_input_is_stored_anyway():
    g = _fc_relu()
    # a second relu reading the stored relu output: recomputing it needs nothing extra
    g2 = Graph.build(names=list(g.names[:4]) + ["relu2", "loss", "grad"], cost=[0, 0, 10.0, 1.0, 1.0, 1.0, 1.0],
                     size=[8, 8, 8, 8, 8, 1, 8],
                     edges=[(0, 2), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (4, 6), (3, 6)],
                     kind=["input", "param"] + ["op"] * 5, backward=[False] * 6 + [True],
                     output=[False] * 6 + [True])
    assert mirror_path(g2)[4] and not mirror_path(g2, max_cost=0.5)[4]
    assert np.array_equal(mirror_path(g), mirror_path(g, max_cost=np.inf))


def _layered_dag(layers: int, width: int, seed: int = 0) -> Graph:
    """A forward-only random layered DAG (no backward flags), like the published ones."""
    rng = np.random.default_rng(seed)
    n = layers * width
    edges = {(v - width + int(rng.integers(width)), v) for v in range(width, n)}
    edges |= {(int(rng.integers(v)), v) for v in range(width, n) for _ in range(2)}
    return Graph.build(cost=rng.uniform(1, 10, n).tolist(), size=rng.integers(10, 100, n).tolist(), edges=edges)


def test_lifetime_splitting_plans_a_dag_without_backward_and_seeds_auto():
    g = _layered_dag(12, 5)
    budget = int(simulate(g, keep_all(g)).peak_bytes * 0.8)
    with pytest.raises(InfeasibleBudget):
        HEURISTICS["chen"](g, budget)
    split = solve(g, budget, solver="split")
    assert simulate(g, split.schedule).peak_bytes <= budget and 0 < split.cost / g.total_cost - 1 < 0.5
    auto = solve(g, budget, solver="auto", time_limit=5, workers=1)
    assert simulate(g, auto.schedule).peak_bytes <= budget and auto.cost <= split.cost
