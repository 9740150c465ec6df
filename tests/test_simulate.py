import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from optremat import Graph, InvalidSchedule, Schedule, from_kept, keep_all, recompute_all, simulate
from optremat.core.schedule import from_computations, read_through, run_peak, without_recomputing, without_unread
from tests.dags import graphs


def brute_force_peak(g: Graph, schedule: Schedule) -> int:
    """Live bytes at every op from first principles: list each event's live interval over
    the flat op sequence, trace every alias or part back to the computation that
    allocated its storage, and count each (allocation, unit) pair held by a live event once."""
    ops = schedule.events
    stage_start = {}
    for p, (_, s, _) in enumerate(ops):
        stage_start.setdefault(s, p)
    intervals = []
    for p, (i, s, u) in enumerate(ops):
        if g.pinned[i] or g.output[i]:
            intervals.append((p, len(ops)))
            continue
        readers = [q for q, (k, s2, _) in enumerate(ops) if s2 == u and q >= p and i in g.preds[k].tolist()]
        end = max(readers) if readers else (p if u == s else stage_start[u] - 1)
        intervals.append((p, end))

    def allocation(q: int) -> int:
        i = ops[q][0]
        if g.alias_of[i] < 0:
            return q
        base = int(g.alias_of[i])
        return allocation(max(r for r in range(q) if ops[r][0] == base and intervals[r][1] >= q))

    peak = 0
    for p in range(len(ops)):
        held = {(allocation(q), unit) for q, (a, b) in enumerate(intervals) if a <= p <= b
                for unit in g.units[ops[q][0]]}
        total = sum(int(g.unit_size[unit]) for _, unit in held)
        peak = max(peak, total + int(g.workspace[ops[p][0]]))
    return peak


def test_hand_counted_chain_with_param():
    # param(10) -> a(5) -> b(5) -> c(5); d(5) reads a, c and the param; e(1) is the loss
    g = Graph.build(cost=[0, 1, 1, 1, 1, 1], size=[10, 5, 5, 5, 5, 1],
                    edges=[(0, 1), (1, 2), (2, 3), (1, 4), (3, 4), (0, 4), (4, 5)],
                    kind=["param"] + ["op"] * 5, output=[False] * 5 + [True])
    res = simulate(g, keep_all(g))
    assert res.curve.tolist() == [10, 15, 20, 25, 25, 16]
    assert res.peak_bytes == 25 and res.cost == 5.0 and res.overhead == 0.0
    frugal = simulate(g, recompute_all(g))
    assert frugal.cost == 15.0 and frugal.overhead == pytest.approx(2.0)
    assert frugal.recomputations == 10


def test_checkpoint_all_costs_one_pass_and_peak_is_sum_on_chain():
    n = 6
    g = Graph.build(cost=[1.0] * n, size=[7] * n, edges=[(i, i + 1) for i in range(n - 1)])
    res = simulate(g, keep_all(g))
    assert res.cost == n and res.peak_bytes == 14


def test_workspace_counts_while_the_op_runs():
    g = Graph.build(cost=[1, 1], size=[4, 4], edges=[(0, 1)], workspace=[0, 100])
    assert simulate(g, keep_all(g)).curve.tolist() == [4, 108]


@settings(max_examples=150)
@given(graphs(), st.data())
def test_simulate_agrees_with_brute_force(g, data):
    kept = data.draw(st.lists(st.booleans(), min_size=g.n, max_size=g.n))
    for schedule in (keep_all(g), recompute_all(g), from_kept(g, np.array(kept))):
        res = simulate(g, schedule)
        assert res.peak_bytes == brute_force_peak(g, schedule)
        assert res.cost >= g.total_cost - 1e-9


@settings(max_examples=150)
@given(graphs(), st.data())
def test_one_pass_is_priced_as_simulate_prices_it(g, data):
    resident = np.nonzero(g.pinned | g.output)[0].tolist()
    assert run_peak(g, range(g.n), [], resident) == simulate(g, keep_all(g)).peak_bytes
    start = data.draw(st.integers(0, g.n))
    held = [v for v in range(start) if g.pinned[v] or g.output[v] or any(k >= start for k in g.succs[v].tolist())]
    later = simulate(g, keep_all(g)).curve[start:]
    assert run_peak(g, range(start, g.n), held, resident) == max([*later, sum_units(g, held)])


def sum_units(g: Graph, nodes: list[int]) -> int:
    return int(sum(g.unit_size[u] for u in {u for v in nodes for u in g.units[v]}))


@settings(max_examples=100)
@given(graphs(), st.data())
def test_keeping_more_never_costs_more_compute(g, data):
    kept = np.array(data.draw(st.lists(st.booleans(), min_size=g.n, max_size=g.n)))
    assert simulate(g, keep_all(g)).cost <= simulate(g, from_kept(g, kept)).cost
    assert simulate(g, from_kept(g, kept)).cost <= simulate(g, recompute_all(g)).cost


@settings(max_examples=150)
@given(graphs(), st.data())
def test_schedules_missing_a_needed_computation_are_rejected(g, data):
    schedule = recompute_all(g)
    events = schedule.events
    victim = data.draw(st.sampled_from([e for e in events if g.succs[e[0]].size and e[1] == e[2]] or [None]))
    assume(victim is not None)
    broken = Schedule.from_events([e for e in events if e != victim], g.n)
    readers_in_stage = [k for k, s, _ in events if s == victim[1] and victim[0] in g.preds[k].tolist()]
    assume(readers_in_stage or victim[0] == victim[1])
    with pytest.raises(InvalidSchedule) as info:
        simulate(g, broken)
    assert info.value.stage == victim[1]


def chain3() -> Graph:
    return Graph.build(cost=[0, 1, 1], size=[4, 4, 4], edges=[(0, 1), (1, 2)], kind=["param", "op", "op"],
                       output=[False, False, True])


@pytest.mark.parametrize("events, message", [
    ([(0, 0, 2), (1, 1, 1), (2, 2, 2)], "input node 1 is not live"),
    ([(0, 0, 2), (1, 1, 2)], "does not compute its own node"),
    ([(0, 0, 1), (1, 1, 2), (2, 2, 2)], "must stay live"),
    ([(0, 0, 2), (1, 1, 2), (1, 2, 2), (2, 2, 2)], "still live"),
    ([(0, 0, 2), (1, 0, 2), (1, 1, 2), (2, 2, 2)], "before its own stage"),
    ([(0, 0, 2), (1, 1, 5), (2, 2, 2)], "outside"),
    ([(0, 0, 2), (0, 1, 2), (1, 1, 2), (2, 2, 2)], "cannot be recomputed|still live"),
])
def test_invalid_schedules_name_stage_and_node(events, message):
    with pytest.raises(InvalidSchedule, match=message):
        simulate(chain3(), Schedule.from_events(events, 3))


def test_schedule_json_round_trip():
    g = chain3()
    s = recompute_all(g)
    assert Schedule.from_json(s.to_json()).events == s.events


def test_what_the_runtime_holds_counts_at_each_computation_and_replays_from_json():
    g = chain3()
    schedule = recompute_all(g)
    held = 10 * np.arange(1, len(schedule.node) + 1)
    running = schedule.running(held, [-1] * len(schedule.node))
    plain, holding = simulate(g, schedule), simulate(g, running, allocations=True)
    assert holding.curve.tolist() == (plain.curve + held).tolist()
    live = np.zeros(len(holding.curve), dtype=np.int64)
    for size, first, end in holding.allocations.tolist():
        live[first:end] += size
    assert live.tolist() == holding.curve.tolist()
    again = Schedule.from_json(running.to_json())
    assert again.held.tolist() == held.tolist() and simulate(g, again).curve.tolist() == holding.curve.tolist()
    with pytest.raises(ValueError, match="one per event"):
        schedule.running([-1] * len(schedule.node), [-1] * len(schedule.node))


def test_a_computation_kept_through_a_later_one_lives_past_its_last_read():
    # x(1) -> a(4) -> b(8); c(16) reads x; d(2) reads b and c. Stage 4 recomputes a, b and
    # c: a's copy is last read by b, and kept through c's computation it counts there too.
    g = Graph.build(cost=[0, 1, 1, 1, 1], size=[1, 4, 8, 16, 2], edges=[(0, 1), (1, 2), (0, 3), (2, 4), (3, 4)],
                    kind=["input"] + ["op"] * 4, output=[False] * 4 + [True])
    schedule = from_computations(g, [(1, 4), (2, 4), (3, 4)])
    through = np.full(len(schedule.node), -1)
    through[schedule.event_index[(1, 4)]] = 3
    plain, kept = simulate(g, schedule), simulate(g, schedule.running(np.zeros_like(through), through))
    at_c, at_d = schedule.event_index[(3, 4)], schedule.event_index[(4, 4)]
    assert (kept.curve - plain.curve).tolist() == [4 if e == at_c else 0 for e in range(len(schedule.node))]
    assert kept.curve[at_d] == plain.curve[at_d]


def test_recomputing_a_base_while_an_alias_holds_its_old_storage_costs_twice():
    # x(10) -> v = view(x); a(1) reads v; b(1) reads x; c(1) reads v and b (the output)
    g = Graph.build(cost=[1.0] * 5, size=[10, 0, 1, 1, 1],
                    edges=[(0, 1), (1, 2), (0, 3), (1, 4), (3, 4)], alias_of=[-1, 0, -1, -1, -1],
                    output=[False] * 4 + [True])
    sched = Schedule.from_events([(0, 0, 1), (1, 1, 4), (2, 2, 2), (0, 3, 3), (3, 3, 4), (4, 4, 4)], 5)
    res = simulate(g, sched)
    assert res.curve.tolist() == [10, 10, 11, 20, 21, 12]
    assert res.peak_bytes == brute_force_peak(g, sched) == 21


@settings(max_examples=150)
@given(graphs(), st.data())
def test_sharing_never_raises_the_peak_and_replays_exactly(g, data):
    kept = data.draw(st.lists(st.booleans(), min_size=g.n, max_size=g.n))
    for schedule in (keep_all(g), recompute_all(g), from_kept(g, np.array(kept))):
        plain = simulate(g, schedule)
        shared = simulate(g, schedule, share=True, allocations=True)
        assert shared.peak_bytes <= plain.peak_bytes and shared.cost == plain.cost
        for k, p in shared.shared.items():
            assert g.shareable[schedule.node[k]] == p
        again = simulate(g, schedule, share=frozenset(shared.shared))
        assert again.curve.tolist() == shared.curve.tolist()
        live = np.zeros(len(shared.curve), dtype=np.int64)
        for size, first, end in shared.allocations.tolist():
            live[first:end] += size
        assert live.tolist() == shared.curve.tolist()


def test_a_share_whose_input_is_still_needed_is_rejected():
    # 0 -> relu-like 1 (may write over 0) -> 2, but 2 also reads 0: 0 is still needed at 1.
    g = Graph.build(cost=[1, 1, 1], size=[8, 8, 8], edges=[(0, 1), (1, 2), (0, 2)], fusible=[False, True, False],
                    tensor=["f32[2]"] * 3, output=[False, False, True])
    assert g.shareable.tolist() == [-1, 0, -1]
    assert simulate(g, keep_all(g), share=True).shared == {}
    with pytest.raises(InvalidSchedule, match="still needed"):
        simulate(g, keep_all(g), share=frozenset({1}))
    chain = Graph.build(cost=[1, 1, 1], size=[8, 8, 8], edges=[(0, 1), (1, 2)], fusible=[False, True, False],
                        tensor=["f32[2]"] * 3, output=[False, False, True])
    result = simulate(chain, keep_all(chain), share=True)
    assert result.shared == {1: 0}
    assert result.curve.tolist() == [8, 8, 16] and simulate(chain, keep_all(chain)).curve.tolist() == [8, 16, 16]


@given(graphs(), st.data())
def test_dropping_recomputations_keeps_one_computation_of_each_masked_node(g, data):
    schedule = recompute_all(g)
    masked = np.array(data.draw(st.lists(st.booleans(), min_size=g.n, max_size=g.n)), dtype=bool)
    dropped = without_recomputing(g, schedule, masked)
    counts = np.bincount(dropped.node, minlength=g.n)
    assert (counts[masked] == 1).all()
    assert (counts[~masked] == np.bincount(schedule.node, minlength=g.n)[~masked]).all()
    result = simulate(g, dropped)
    assert result.cost <= simulate(g, schedule).cost + 1e-9
    assert result.peak_bytes == brute_force_peak(g, dropped)


def test_an_op_read_through_keeps_its_inputs_until_its_reader_runs():
    # a(10), b(10) -> c = a + b (10); x(10) runs between c and its reader d(10)
    g = Graph.build(cost=[1] * 5, size=[10] * 5, edges=[(0, 2), (1, 2), (3, 4), (2, 4)], output=[False] * 4 + [True])
    assert simulate(g, keep_all(g)).curve.tolist() == [10, 20, 30, 20, 30]
    priced = read_through(g, np.array([False, False, True, False, False]))
    assert simulate(priced, keep_all(priced)).curve.tolist() == [10, 20, 20, 30, 40]


@given(graphs(), st.data())
def test_reading_through_ops_runs_every_computation_and_is_priced_from_first_principles(g, data):
    kept = np.array(data.draw(st.lists(st.booleans(), min_size=g.n, max_size=g.n)))
    schedule = from_kept(g, kept)
    inline = np.array(data.draw(st.lists(st.booleans(), min_size=g.n, max_size=g.n))) & ~g.pinned
    priced = read_through(g, inline)
    through = without_recomputing(priced, schedule, g.pinned)
    assert sorted(through.node.tolist()) == sorted(schedule.node.tolist())
    assert simulate(priced, through).peak_bytes == brute_force_peak(priced, through)
    unchanged = read_through(g, np.zeros(g.n, dtype=bool))
    assert unchanged.fingerprint == g.fingerprint


@given(graphs(), st.data())
def test_dropping_unread_recomputations_keeps_every_read_and_never_costs_more(g, data):
    kept = np.array(data.draw(st.lists(st.booleans(), min_size=g.n, max_size=g.n)))
    extra = data.draw(st.lists(st.tuples(st.integers(0, g.n - 1), st.integers(0, g.n - 1)), max_size=4))
    recomputed = [(i, s) for i, s, _ in from_kept(g, kept).events if s != i]
    padded = from_computations(g, recomputed + [(i, s) for i, s in extra if s > i and not (g.pinned[i] or g.output[i])])
    pruned = without_unread(g, padded)
    assert simulate(g, pruned).peak_bytes <= simulate(g, padded).peak_bytes
    assert simulate(g, pruned).cost <= simulate(g, padded).cost
    stages = {i: sorted(s for k, s, _ in pruned.events if k == i) for i in range(g.n)}
    served = {(p, max(t for t in stages[p] if t <= s)) for k, s, _ in pruned.events for p in g.preds[k].tolist()}
    assert all((i, s) in served for i, s, _ in pruned.events if s != i)
