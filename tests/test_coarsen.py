import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optremat import extract, from_kept, keep_all, recompute_all, simulate
from optremat.core.coarsen import coarsen
from optremat.models import build
from tests.dags import graphs


@pytest.fixture(scope="module", params=["gpt-tiny", "resnet-tiny", "unet-tiny", "rnn-tiny"])
def model_graph(request):
    example = build(request.param)
    return extract(example.model, example.inputs, example.loss_fn)


@pytest.mark.parametrize("by_module", [False, True])
def test_coarse_plans_map_back_to_every_op(model_graph, by_module):
    c = coarsen(model_graph, by_module=by_module)
    assert c.coarse.n < model_graph.n / 1.5
    assert sorted(c.original.tolist()) == list(range(model_graph.n))
    assert c.coarse.total_cost == pytest.approx(model_graph.total_cost)
    for schedule in (keep_all(c.coarse), recompute_all(c.coarse)):
        fine = c.expand(schedule)
        assert set(fine.node.tolist()) == set(range(c.fine.n))
        coarse_res, fine_res = simulate(c.coarse, schedule), simulate(c.fine, fine)
        assert fine_res.cost == pytest.approx(coarse_res.cost)
        assert fine_res.peak_bytes <= 1.25 * coarse_res.peak_bytes


def test_views_fold_into_their_producer(model_graph):
    c = coarsen(model_graph)
    fine = c.fine
    resident_group = c.group[int(np.argmax(fine.pinned))]
    for i in np.nonzero((fine.alias_of >= 0) & (fine.size == 0))[0].tolist():
        base = fine.alias_of[i]
        if c.group[base] == resident_group and fine.backward[i]:
            assert c.group[i] != c.group[base], "a backward view must not run with the resident group"
        elif fine.fusible[i] and not fine.output[i] and len(fine.preds[i]) == 1:
            assert c.group[i] == c.group[base]


def test_nothing_that_reads_the_output_gradient_runs_before_the_forward_ends():
    example = build("gpt-tiny")
    fine = coarsen(extract(example.model, example.inputs)).fine
    tangents = [i for i in range(fine.n) if fine.pinned[i] and fine.kind[i] == "input"
                and len(fine.succs[i]) and fine.backward[fine.succs[i]].all()]
    depends = np.zeros(fine.n, dtype=bool)
    depends[tangents] = True
    for v in range(fine.n):
        depends[v] |= bool(depends[fine.preds[v]].any())
    first = int(np.argmax(depends & ~fine.pinned))
    assert tangents and not (~fine.backward[first:] & ~fine.pinned[first:]).any()


def test_unplanned_peak_is_kept_within_a_quarter(model_graph, request):
    """Coarsening may hold a group's outputs together, never lose bytes."""
    if "rnn-tiny" in request.node.name:
        request.applymarker(pytest.mark.xfail(strict=True, reason="known gap: groups around the LSTM's "
                                              "in-place add_ undercount its storage by about 11%"))
    c = coarsen(model_graph)
    fine_peak = simulate(model_graph, keep_all(model_graph)).peak_bytes
    coarse_peak = simulate(c.coarse, keep_all(c.coarse)).peak_bytes
    assert fine_peak * 0.99 <= coarse_peak <= fine_peak * 1.25


@settings(max_examples=100)
@given(graphs(), st.booleans(), st.data())
def test_expansion_is_valid_on_random_graphs(g, by_module, data):
    c = coarsen(g, by_module=by_module)
    kept = np.array(data.draw(st.lists(st.booleans(), min_size=c.coarse.n, max_size=c.coarse.n)))
    schedule = from_kept(c.coarse, kept)
    fine = simulate(c.fine, c.expand(schedule))
    assert fine.cost == pytest.approx(simulate(c.coarse, schedule).cost)
