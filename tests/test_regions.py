"""Region plans: every keep set lowers to regions whose schedule runs, and a plan read back
from its keys (as at another input shape) is the same plan."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import optremat
from optremat.models import build
from optremat.planners import regions
from optremat.planners.regions import RegionMap, kept_of, parse_span, price, search, span_path
from optremat.planning.native import region_map
from optremat.tracing.extract import trace

MODELS = ("gpt-tiny", "resnet-tiny", "mlp-tiny", "rnn-tiny", "unet-tiny", "vgg-tiny")


@functools.lru_cache(maxsize=None)
def built_map(name: str) -> RegionMap:
    example = build(name)
    return region_map(trace(example.model, example.inputs, example.loss_fn), example.model, "cpu")


@settings(max_examples=60)
@given(name=st.sampled_from(MODELS), data=st.data())
def test_any_keep_set_lowers_to_a_schedule_that_runs_and_reads_back(name: str, data: st.DataObject) -> None:
    rmap = built_map(name)
    structures = rmap.structures()
    structure = structures[data.draw(st.integers(0, len(structures) - 1))]
    seed = data.draw(st.integers(0, 2**31 - 1))
    kept = np.random.default_rng(seed).random(rmap.graph.n) < data.draw(st.floats(0, 1))
    priced = price(rmap, structure, kept, "random")
    unplanned = optremat.simulate(rmap.graph, optremat.keep_all(rmap.graph))
    assert priced.result.cost >= unplanned.cost
    assert all((r.path, r.call) in structure for r in priced.lowering.regions)
    again = price(rmap, *kept_of(rmap, priced.lowering.regions), "again")
    assert again.lowering.regions == priced.lowering.regions
    assert (again.result.peak_bytes, again.result.cost) == (priced.result.peak_bytes, priced.result.cost)


def test_span_paths_read_back() -> None:
    assert parse_span(span_path("features", 2, 5)) == ("features", 2, 5)
    assert parse_span(span_path("", 0, 3)) == ("", 0, 3)
    assert parse_span("blocks.0") is None


@pytest.mark.parametrize("name", ["mlp-tiny", "gpt-tiny"])
def test_structures_hold_every_depth_and_sequential_spans(name: str) -> None:
    rmap = built_map(name)
    structures = rmap.structures()
    spans = [s for s in structures if all(parse_span(path) for path, _ in s)]
    calls = [s for s in structures if not any(parse_span(path) for path, _ in s)]
    sequences = {parse_span(path)[0] for structure in spans for path, _ in structure}
    assert sequences == ({""} if name == "mlp-tiny" else {"blocks.0.mlp", "blocks.1.mlp"})
    for structure in spans:
        members = np.concatenate([rmap.members[c] for c in structure])
        assert len(members) == len(set(members.tolist())), "the spans of one structure tile without overlap"
    if name == "gpt-tiny":
        assert [c for c, _ in calls[0]][:2] == ["tok", "pos"] and ("blocks.0", 0) in calls[0]


def test_random_ops_are_never_saved() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Dropout(0.5), torch.nn.GELU())
                                  for _ in range(4)])
    inputs = (torch.randn(64, 32),)
    rmap = region_map(trace(model, inputs, lambda out: out.sum()), model, "cpu")
    structure = next(s for s in rmap.structures() if s[0][0] == "0")
    for kept in (np.zeros(rmap.graph.n, dtype=bool), rmap.random.copy()):
        regions = price(rmap, structure, kept, "any").lowering.regions
        assert regions, "dropping activations checkpoints the blocks"
        saved = {op for region in regions for op, _ in region.saved}
        assert not saved & {"bernoulli_.float", "native_dropout.default", "bernoulli.p"}, saved


def mlp(width: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))


@functools.lru_cache(maxsize=None)
def nested_map() -> RegionMap:
    """A Sequential of Sequentials of Sequentials: spans of each level nest in the level above."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(mlp(8), mlp(8), mlp(8)) for _ in range(5)], torch.nn.Linear(8, 2))
    return region_map(trace(model, (torch.randn(32, 8),), lambda out: out.square().mean()), model, "cpu")


@settings(max_examples=20)
@given(data=st.data())
def test_nested_sequentials_give_structures_of_calls_sharing_no_op(data: st.DataObject) -> None:
    rmap = nested_map()
    structures = rmap.structures()
    assert {parse_span(path)[0] for s in structures for path, _ in s if parse_span(path)} >= {"", "0", "0.0"}
    for structure in structures:
        members = np.concatenate([rmap.members[call] for call in structure])
        assert len(members) == len(set(members.tolist())), structure
    structure = structures[data.draw(st.integers(0, len(structures) - 1))]
    kept = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1))).random(rmap.graph.n) < data.draw(st.floats(0, 1))
    priced = price(rmap, structure, kept, "random")
    assert all((r.path, r.call) in structure for r in priced.lowering.regions)


def test_a_sequential_listing_a_module_twice_has_no_spans() -> None:
    """Its second call of the module has the first one's path, so no run of its children
    can be told apart; the Sequentials around it keep theirs, each span holding exactly
    its children's ops."""
    torch.manual_seed(0)
    shared = mlp(8)
    model = torch.nn.Sequential(torch.nn.Sequential(shared, mlp(8), shared), mlp(8), mlp(8), torch.nn.Linear(8, 2))
    rmap = region_map(trace(model, (torch.randn(32, 8),), lambda out: out.square().mean()), model, "cpu")
    spans = {parse_span(path) for path, _ in rmap.members if parse_span(path)}
    assert spans and all(path != "0" for path, _, _ in spans)
    for path, start, stop in spans:
        children = np.concatenate([rmap.members[(f"{path}.{k}" if path else str(k), 0)] for k in range(start, stop)])
        assert sorted(children.tolist()) == rmap.members[(span_path(path, start, stop), 0)].tolist()


class Scored(torch.nn.Module):
    """Computes the step's loss itself, ending in an op whose autograd node saves its output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.lin(x).square().mean())


def test_a_step_result_computed_in_a_region_is_saved_not_recomputed() -> None:
    """The caller holds the result, so a rerun recomputing it would make a second copy:
    the region's policy saves it, as it saves an output the backward reads after the call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(mlp(8), Scored())
    rmap = region_map(trace(model, (torch.randn(32, 8),), lambda out: out), model, "cpu")
    loss = int(np.nonzero(rmap.graph.output & ~rmap.graph.backward & ~rmap.graph.pinned)[0][0])
    assert loss in rmap.reruns[("1", 0)].read_after
    priced = price(rmap, (("0", 0), ("1", 0)), np.zeros(rmap.graph.n, dtype=bool), "everything dropped")
    region = next(r for r in priced.lowering.regions if r.path == "1")
    assert ("exp.default", 0) in region.saved


def test_calls_nested_in_one_another_are_refused_as_regions() -> None:
    rmap = nested_map()
    with pytest.raises(ValueError, match="share ops"):
        price(rmap, (("0", 0), ("0.1", 0)), np.zeros(rmap.graph.n, dtype=bool), "nested")


class Late:
    """A clock already past any deadline."""

    @staticmethod
    def perf_counter() -> float:
        return float("inf")


def test_seeds_stop_at_the_deadline_once_a_plan_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its deadline the seed search searches no further structure once a plan fits
    (each took seconds of whole-step simulations on a 40-layer Llama); before one fits,
    it goes on."""
    rmap = built_map("gpt-tiny")
    budget = rmap.graph.size.sum()  # anything fits
    everything = search(rmap, budget, None)
    monkeypatch.setattr(regions, "time", Late)
    assert search(rmap, budget, None, deadline=0.0, have=everything[:1]) == []
    first = search(rmap, budget, None, deadline=0.0)
    assert first and len(first) < len(everything)
