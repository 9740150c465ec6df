"""Arena layouts: no two live tensors overlap, the arena meets the live-bytes bound, and
CP-SAT never does worse than greedy."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import optremat
from optremat import from_kept, keep_all, recompute_all, simulate
from optremat.ilp.layout import allocations, cpsat_layout, greedy_layout, layout
from optremat.models import build
from tests.dags import graphs


def schedules(g, kept):
    return (keep_all(g), recompute_all(g), from_kept(g, np.array(kept)))


@settings(max_examples=150)
@given(graphs(), st.data())
def test_allocations_add_up_to_the_simulated_memory_curve(g, data):
    kept = data.draw(st.lists(st.booleans(), min_size=g.n, max_size=g.n))
    for schedule in schedules(g, kept):
        result = simulate(g, schedule, allocations=True)
        live = np.zeros(len(result.curve), dtype=np.int64)
        for size, first, end in result.allocations.tolist():
            assert 0 <= first < end <= len(result.curve)
            live[first:end] += size
        assert live.tolist() == result.curve.tolist()


@settings(max_examples=100)
@given(graphs(), st.data())
def test_layouts_never_overlap_live_tensors_and_cpsat_is_no_worse_than_greedy(g, data):
    kept = data.draw(st.lists(st.booleans(), min_size=g.n, max_size=g.n))
    for schedule in schedules(g, kept):
        table = allocations(g, schedule, alignment=1)
        greedy = greedy_layout(table)
        exact = cpsat_layout(table, time_limit=5, hint=greedy)
        for found in (greedy, exact):
            assert found.overlapping() is None
            assert (found.offsets >= 0).all()
            assert found.live_bytes == (simulate(g, schedule).peak_bytes if len(table) else 0)
            assert found.arena_bytes == int((found.offsets + found.sizes).max(initial=0)) >= found.live_bytes
        assert exact.arena_bytes <= greedy.arena_bytes


def test_greedy_by_size_on_a_known_case_and_cpsat_proves_it():
    # A (8 bytes) lives [0,2), B (4) [1,4), C (8) [3,5), D (4) [2,3); at most 12 bytes are live.
    table = np.array([[8, 0, 2], [4, 1, 4], [8, 3, 5], [4, 2, 3]])
    greedy = greedy_layout(table)
    assert greedy.offsets.tolist() == [0, 8, 0, 0] and greedy.arena_bytes == greedy.live_bytes == 12
    exact = cpsat_layout(table, time_limit=5)
    assert exact.arena_bytes == 12 and exact.status == "OPTIMAL"


def test_cpsat_removes_fragmentation_greedy_leaves():
    # Greedy stacks the 4-byte tensors at 0 and 4, so a 3-byte one alive beside both goes
    # to 8: an arena of 11 for 8 live bytes; CP-SAT finds the layout that needs only 8.
    table = np.array([[4, 0, 2], [4, 1, 3], [3, 2, 4], [4, 3, 5], [3, 0, 1]])
    greedy = greedy_layout(table)
    exact = cpsat_layout(table, time_limit=5, hint=greedy)
    assert (greedy.arena_bytes, greedy.live_bytes) == (11, 8)
    assert exact.overlapping() is None and exact.status == "OPTIMAL" and exact.arena_bytes == 8


def test_layout_of_a_plan_reports_arena_and_live_peak():
    example = build("resnet-tiny")
    plan = optremat.plan(example.model, example.inputs, 0.9, loss_fn=example.loss_fn, time_limit=5)
    found = layout(plan.graph, plan.schedule, "greedy")
    assert found.overlapping() is None
    assert found.live_bytes >= plan.predicted_peak_bytes
    assert found.arena_bytes >= found.live_bytes
    assert "arena" in plan.summary()
