import pytest

from optremat import Graph, InfeasibleBudget, keep_all, simulate, solve
from optremat.heuristics import NotAChain, chain_dp
from optremat.ilp.cpsat import solve_cpsat
from tests.dags import training_chain


def exact_cost(g: Graph, budget: int) -> float | None:
    try:
        return solve_cpsat(g, budget, copies=g.n, workers=1, time_limit=60).cost
    except InfeasibleBudget:
        return None


def dp_cost(g: Graph, budget: int) -> float | None:
    try:
        schedule = chain_dp(g, budget)
    except InfeasibleBudget:
        return None
    result = simulate(g, schedule)
    assert result.peak_bytes <= budget
    return result.cost


@pytest.mark.parametrize("layers", [3, 5, 8])
def test_dp_is_optimal_on_uniform_chains_at_every_budget(layers):
    g = training_chain([1.0] * layers, [4] * layers)
    peak = simulate(g, keep_all(g)).peak_bytes
    for budget in range(8, peak + 1, 4):
        assert dp_cost(g, budget) == exact_cost(g, budget), budget


@pytest.mark.slow
def test_dp_is_optimal_on_a_uniform_chain_of_30_nodes():
    g = training_chain([1.0] * 14, [4] * 14)
    peak = simulate(g, keep_all(g)).peak_bytes
    for budget in (peak // 4, peak // 3, peak // 2):
        assert dp_cost(g, budget) == exact_cost(g, budget), budget


def test_dp_never_beats_the_exact_solver_on_heterogeneous_chains():
    g = training_chain([1.0, 3.0, 2.0, 1.0, 4.0, 2.0], [4, 9, 2, 6, 3, 5])
    peak = simulate(g, keep_all(g)).peak_bytes
    for fraction in (0.45, 0.6, 0.75):
        budget = int(peak * fraction)
        exact, dp = exact_cost(g, budget), dp_cost(g, budget)
        assert (exact is None) == (dp is None) or dp is None
        if dp is not None:
            assert exact <= dp <= exact * 1.1


def test_exact_solvers_beat_persistent_checkpointing_on_this_chain():
    # The solver keeps f_1 through the sweep, advances f_1 -> f_2 for b_3 and drops f_1
    # there, then recomputes f_1 from the input for b_2: a non-persistent schedule outside
    # the DP's class, one unit cheaper.
    g = training_chain([1.0, 4.0, 1.0, 4.0, 4.0], [1, 8, 5, 4, 2])
    assert dp_cost(g, 18) == 48.0 and exact_cost(g, 18) == 47.0


def test_infeasible_budget_names_the_smallest_that_fits():
    g = training_chain([1.0] * 6, [4] * 6)
    with pytest.raises(InfeasibleBudget) as error:
        chain_dp(g, 5)
    assert dp_cost(g, error.value.smallest) is not None and dp_cost(g, error.value.smallest - 1) is None


def test_dp_refuses_graphs_that_are_not_chains():
    skip = Graph.build(cost=[1.0] * 4, size=[1] * 4, edges=[(0, 1), (1, 2), (0, 2), (2, 3)])
    with pytest.raises(NotAChain, match="training chains"):
        chain_dp(skip, 10)
    with pytest.raises(NotAChain):
        solve(skip, 1, solver="dp")
