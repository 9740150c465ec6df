"""Deterministic CP-SAT searches over hinted models that no plan satisfies end normally.

CP-SAT 9.15 aborts the process when its interleaved search proves a hinted model
infeasible while loading it, so each such search runs in a subprocess of its own."""

import subprocess
import sys

import numpy as np
import pytest

from optremat import keep_all, resolve_budget
from optremat.core.synthetic import training_chain
from optremat.ilp.interval import IntervalModel
from optremat.ilp.search import safe_hint
from optremat.planners.solve import heuristic

INFEASIBLE_HINTED = """
import sys
from optremat import keep_all, solve
from optremat.core.budget import InfeasibleBudget
from optremat.ilp import search
from optremat.core.synthetic import training_chain

search.PRESOLVE_LIMIT = 0
graph = training_chain([1.0] * 5, [4] * 5)
try:
    solve(graph, 12, sys.argv[1], time_limit=10, hint=keep_all(graph), workers=2, deterministic=True)
except InfeasibleBudget as error:
    assert error.smallest > 12
else:
    raise AssertionError("a 12-byte budget fits no plan of the chain")
"""
"""A 5-layer chain hinted with its unplanned schedule (29 bytes) at a budget below any
plan's peak, with presolve skipped as it is on hinted models of over PRESOLVE_LIMIT
nodes: the 500-layer chain (1,002 nodes) at 12 bytes reaches the abort unpatched."""


@pytest.mark.parametrize("solver", ["cpsat", "auto"])
def test_deterministic_search_from_an_infeasible_hint_raises_infeasible_budget(solver):
    done = subprocess.run([sys.executable, "-c", INFEASIBLE_HINTED, solver], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def hinted_model(graph, budget, schedule) -> IntervalModel:
    """The interval model under `budget`, with copies enough for `schedule`, hinted from it."""
    model = IntervalModel(graph, int(np.bincount(schedule.node).max()), budget)
    model.model.minimize(model.extra_cost)
    model.hint(schedule)
    return model


def test_a_hint_that_fits_is_kept_and_one_over_budget_dropped():
    graph = training_chain([1.0] * 8, [4] * 8)
    budget = resolve_budget(graph, 0.6)
    fitting = hinted_model(graph, budget, heuristic(graph, budget, "chen").schedule)
    assert safe_hint(fitting, "none") == "none" and len(fitting.model.proto.solution_hint.vars)
    over = hinted_model(graph, budget, keep_all(graph))
    assert safe_hint(over, "none") == "full" and not len(over.model.proto.solution_hint.vars)
