import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model

from optremat import Graph, from_kept, keep_all, resolve_budget, simulate
from optremat.core.budget import InfeasibleBudget
from optremat.core.synthetic import random_training_graph
from optremat.ilp import search
from optremat.ilp.cpsat import min_peak_cpsat, solve_cpsat
from optremat.ilp.milp import solve_lp_rounding, solve_milp
from tests.bruteforce import optimum
from tests.dags import graphs, training_chain

EXHAUSTIVE = settings(max_examples=200)


def check_against_brute_force(g: Graph, fraction: float, solve, share: bool = False) -> None:
    budget = int(simulate(g, keep_all(g)).peak_bytes * fraction)
    best = optimum(g, budget, share)
    if best is None:
        with pytest.raises(InfeasibleBudget) as error:
            solve(g, budget)
        assert error.value.smallest > budget
        return
    solution = solve(g, budget)
    result = simulate(g, solution.schedule, share=frozenset(solution.shared))
    assert result.peak_bytes <= budget and result.shared == solution.shared
    assert solution.cost == pytest.approx(best[0], abs=1e-9)
    again = simulate(g, best[1], share=share)
    assert again.peak_bytes <= budget and again.cost == pytest.approx(best[0])


@EXHAUSTIVE
@given(graphs(max_nodes=8), st.floats(0.3, 1.0))
def test_cpsat_matches_brute_force_with_shared_storage(g, fraction):
    check_against_brute_force(g, fraction, lambda g, b: solve_cpsat(g, b, copies=g.n, time_limit=30, workers=1))


@settings(EXHAUSTIVE, max_examples=100)
@given(graphs(max_nodes=8, typed=True), st.floats(0.3, 1.0))
def test_cpsat_with_share_matches_brute_force(g, fraction):
    check_against_brute_force(g, fraction, lambda g, b: solve_cpsat(g, b, copies=g.n, time_limit=30, workers=1,
                                                                      share=True), share=True)


@EXHAUSTIVE
@given(graphs(max_nodes=8, shared_storage=False), st.floats(0.3, 1.0))
def test_milp_matches_brute_force_without_shared_storage(g, fraction):
    check_against_brute_force(g, fraction, lambda g, b: solve_milp(g, b, time_limit=30))


@settings(EXHAUSTIVE, max_examples=25)
@given(graphs(max_nodes=8, shared_storage=False, typed=True), st.floats(0.3, 1.0))
def test_milp_with_share_matches_brute_force(g, fraction):
    check_against_brute_force(g, fraction, lambda g, b: solve_milp(g, b, time_limit=30, share=True), share=True)


def test_a_budget_only_sharing_reaches():
    # x -> a -> b with b pointwise over a: computing b holds x, a and b (24 bytes) unless
    # b writes over a, which dies there.
    g = Graph.build(cost=[0.0, 1.0, 1.0], size=[8, 8, 8], edges=[(0, 1), (1, 2)], kind=["input", "op", "op"],
                    output=[False, False, True], fusible=[False, False, True], tensor=["f32[2]"] * 3)
    assert g.shareable.tolist() == [-1, -1, 1]
    for planner in (solve_cpsat, solve_milp):
        with pytest.raises(InfeasibleBudget) as error:
            planner(g, 16)
        assert error.value.smallest == 24
        solution = planner(g, 16, share=True)
        assert solution.shared == {2: 1} and solution.cost == g.total_cost
        assert simulate(g, solution.schedule, share=frozenset(solution.shared)).peak_bytes == 16


@settings(max_examples=50)
@given(graphs(max_nodes=10), st.floats(0.3, 1.0))
def test_lp_rounding_fits_or_says_infeasible(g, fraction):
    budget = int(simulate(g, keep_all(g)).peak_bytes * fraction)
    try:
        solution = solve_lp_rounding(g, budget)
    except InfeasibleBudget as error:
        assert error.smallest > 0
        return
    assert simulate(g, solution.schedule).peak_bytes <= budget


@settings(max_examples=50)
@given(graphs(max_nodes=7))
def test_min_peak_is_the_smallest_budget_with_a_plan(g):
    solution = min_peak_cpsat(g, copies=g.n, workers=1)
    peak = simulate(g, solution.schedule).peak_bytes
    assert solution.lower_bound == peak
    assert optimum(g, peak) is not None and optimum(g, peak - 1) is None


def test_cost_cap_trades_memory_for_time():
    chain = training_chain([1.0] * 8, [4] * 8)
    unplanned = simulate(chain, keep_all(chain))
    no_extra = min_peak_cpsat(chain, max_overhead=0.0, workers=1)
    some = min_peak_cpsat(chain, max_overhead=0.25, workers=1)
    unbounded = min_peak_cpsat(chain, workers=1)
    peaks = [simulate(chain, s.schedule).peak_bytes for s in (no_extra, some, unbounded)]
    assert peaks[0] == unplanned.peak_bytes and peaks[0] > peaks[1] >= peaks[2]
    assert simulate(chain, some.schedule).overhead <= 0.25
    assert all(s.status == "OPTIMAL" and s.lower_bound == p for s, p in zip((no_extra, some, unbounded), peaks))


def test_exact_formulations_agree_on_a_uniform_chain_at_every_budget():
    chain = training_chain([1.0] * 6, [4] * 6)
    unplanned = simulate(chain, keep_all(chain)).peak_bytes
    smallest = simulate(chain, min_peak_cpsat(chain, copies=chain.n, workers=1).schedule).peak_bytes
    previous = None
    for budget in list(range(smallest, unplanned, 2)) + [unplanned]:
        interval = solve_cpsat(chain, budget, copies=chain.n, workers=1)
        checkmate = solve_milp(chain, budget)
        assert interval.cost == pytest.approx(checkmate.cost)
        assert interval.status == checkmate.status == "OPTIMAL"
        assert previous is None or interval.cost <= previous
        previous = interval.cost
    assert previous == chain.total_cost


def test_a_hint_is_accepted_and_never_beaten_by_the_result():
    chain = training_chain([1.0, 2.0, 1.0, 3.0, 1.0, 2.0, 1.0, 1.0], [8, 4, 8, 12, 4, 8, 8, 4])
    budget = int(simulate(chain, keep_all(chain)).peak_bytes * 0.7)
    from optremat.heuristics import chen_greedy

    seed = chen_greedy(chain, budget)
    hinted = solve_cpsat(chain, budget, hint=seed, workers=1, deterministic=True, time_limit=5)
    assert hinted.cost <= simulate(chain, seed).cost
    again = solve_cpsat(chain, budget, hint=seed, workers=1, deterministic=True, time_limit=5)
    assert again.schedule.events == hinted.schedule.events


@settings(max_examples=60)
@given(graphs(max_nodes=10), st.floats(0.5, 1.0))
def test_a_feasible_hint_is_valid_and_the_result_is_no_worse(g, fraction):
    kept = np.arange(g.n) % 2 == 0
    for hint in (from_kept(g, kept), from_kept(g, kept, reuse=True), keep_all(g)):
        result = simulate(g, hint)
        budget = max(result.peak_bytes, int(simulate(g, keep_all(g)).peak_bytes * fraction))
        if result.peak_bytes > budget:
            continue
        solution = solve_cpsat(g, budget, hint=hint, copies=g.n, workers=1, time_limit=30)
        assert solution.cost <= result.cost + 1e-9


def test_a_stalled_search_restarts_from_its_best_plan_and_never_goes_back(monkeypatch):
    """A timer that fires at once stands in for the clock: the first two rounds stall at
    their first plan, the third runs on. What is asserted holds whatever the last round's
    time limit allows: three rounds, each better plan reported strictly cheaper, bounds
    that only rise, and the last report is the plan returned, within budget."""
    stalls = 2
    rounds = []

    class CountingSolver(cp_model.CpSolver):
        def __init__(self) -> None:
            super().__init__()
            rounds.append(self)

    class StallAtOnce:
        """A timer that fires as soon as it starts, in the first `stalls` rounds only."""

        def __init__(self, interval: float, function) -> None:
            self.function, self.daemon = function, False

        def start(self) -> None:
            if len(rounds) <= stalls:
                self.function()

        def cancel(self) -> None:
            pass

    monkeypatch.setattr(search, "threading", SimpleNamespace(Timer=StallAtOnce))
    monkeypatch.setattr(search, "LEAST_RESTART", -math.inf)
    monkeypatch.setattr(search, "RESTART_GAP", 0.0)
    monkeypatch.setattr(search.cp_model, "CpSolver", CountingSolver)
    g = random_training_graph(40)
    budget = resolve_budget(g, 0.5)
    reports = []
    solution = solve_cpsat(g, budget, time_limit=3, workers=1, progress=lambda *report: reports.append(report))
    assert len(rounds) == stalls + 1
    costs, bounds = [r[1] for r in reports], [r[2] for r in reports]
    assert all(a > b for a, b in zip(costs, costs[1:])) and bounds == sorted(bounds)
    assert solution.cost == pytest.approx(costs[-1]) and solution.lower_bound <= solution.cost
    assert simulate(g, solution.schedule).peak_bytes <= budget

    rounds.clear()
    roomy = resolve_budget(g, 1.0)  # the first plan is found at once, however loaded the machine
    solve_cpsat(g, roomy, time_limit=1, workers=1, deterministic=True)
    assert len(rounds) == 1, "a deterministic search never restarts"

    monkeypatch.setattr(search, "RESTART_GAP", 1.0)
    rounds.clear()
    solve_cpsat(g, roomy, time_limit=1, workers=1)
    assert len(rounds) == 1, "a search within RESTART_GAP of its bound runs on"
