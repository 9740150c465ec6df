"""Plans of a chain of identical blocks solved once per block and composed
(`optremat.ilp.composed`): on Llamas from transformers configs, small enough for the
search over every plan of regions inside the blocks to prove its optimum, the composed
plan is that optimum (same cost, same simulated peak) and its bound never exceeds it; a
long chain is planned by composition alone, and the plan trains as the model does (slow:
16 blocks, planned and trained), or refuses a budget no composition fits (slow); on a
tiny chain, against every plan inside its blocks."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import optremat
from optremat.core.schedule import keep_all, peak_floor, simulate
from optremat.ilp.composed import FrontierMemo, solve_chain
from optremat.ilp.region_cpsat import solve_regions
from optremat.ilp.region_model import RegionModel
from optremat.planners.chain import BACKWARD, FORWARD, MIDDLE, chain_of
from optremat.planners.regions import price
from optremat.planning.native import region_map
from optremat.tracing.causal_lm import running
from optremat.tracing.extract import trace
from tests.test_region_model import every_plan

transformers = pytest.importorskip("transformers")


def llama(layers: int, sequence: int = 64, width: int = 64) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=64,
                                      max_position_embeddings=sequence, use_cache=False)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, sequence))
    return model, {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def four_blocks():
    model, batch = llama(4)
    rmap = region_map(trace(model, batch, None), model, "cpu")
    return rmap, chain_of(rmap)


def test_the_decoder_layers_are_the_chain(four_blocks) -> None:
    rmap, chain = four_blocks
    assert [path for path, _ in chain.blocks] == [f"model.layers.{k}" for k in range(4)]
    kinds = [(s.kind, s.block) for s in chain.segments if s.kind in (FORWARD, BACKWARD, MIDDLE)]
    assert kinds == [(FORWARD, k) for k in range(4)] + [(MIDDLE, -1)] + [(BACKWARD, k) for k in (3, 2, 1, 0)]
    assert all(len(inner) == len(chain.inner[0]) for inner in chain.inner)
    assert chain.moved(((optremat.Region("model.layers.2.mlp", 0)),), 2, 0) == (optremat.Region("model.layers.0.mlp", 0),)


@pytest.mark.parametrize("fraction", [0.85, pytest.param(0.75, marks=pytest.mark.slow)])
def test_composition_meets_the_search_over_every_plan_inside_the_blocks(four_blocks, fraction: float) -> None:
    rmap, chain = four_blocks
    budget = int(fraction * simulate(rmap.graph, keep_all(rmap.graph)).peak_bytes)
    composed = solve_chain(chain, budget, 10, deterministic=True)
    exact = solve_regions(rmap, [call for inner in chain.inner for call in inner], budget, 30, deterministic=True)
    assert exact.optimal
    assert math.isfinite(composed.bound) and composed.bound <= exact.priced.cost * (1 + 1e-9)
    assert composed.priced.cost == pytest.approx(exact.priced.cost, rel=1e-9)
    assert composed.priced.result.peak_bytes == exact.priced.result.peak_bytes <= budget


def test_a_budget_no_plan_fits_composes_nothing_and_bounds_at_infinity(four_blocks) -> None:
    rmap, chain = four_blocks
    composed = solve_chain(chain, int(rmap.graph.size[rmap.graph.pinned].sum()), 10, deterministic=True)
    assert composed.priced is None
    assert composed.bound == float("inf")


def test_no_chain_in_a_model_without_repeated_blocks() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    rmap = region_map(trace(model, torch.randn(4, 8), None), model, "cpu")
    assert chain_of(rmap) is None


@pytest.mark.slow
def test_a_long_chain_is_planned_by_composition_and_trains_as_the_model_does() -> None:
    model, batch = llama(16, sequence=128, width=256)
    planned = optremat.plan(model, batch, 0.8, deterministic=True, time_limit=10)
    assert planned.solver.startswith("composed (16 blocks")
    assert planned.predicted_peak_bytes <= planned.budget_bytes
    assert planned.lower_bound <= planned.predicted_overhead <= planned.lower_bound * 1.01 + 0.01
    assert planned.regions
    reference = copy.deepcopy(model)
    optremat.apply(model, planned)
    loss = model(**batch).loss
    loss.backward()
    expected = reference(**batch).loss
    expected.backward()
    assert torch.equal(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.slow
def test_a_long_chain_refuses_a_budget_at_its_floor_naming_one_it_meets() -> None:
    """16 blocks at the step's floor: no composition and no structure checkpointed whole
    fits, so the budget is refused without the search over every region set, naming the
    floor and the least peak reached, and a plan meets that least peak."""
    model, batch = llama(16)
    options = dict(deterministic=True, time_limit=5, head_chunks=None)
    floor = peak_floor(optremat.plan(model, batch, 1.0, **options).graph)
    with pytest.raises(optremat.InfeasibleBudget) as refused:
        optremat.plan(model, batch, floor, **options)
    assert refused.value.floor == floor and refused.value.smallest > floor
    met = optremat.plan(model, batch, refused.value.smallest, **options)
    assert met.predicted_peak_bytes <= refused.value.smallest


def test_a_long_chain_under_its_floor_is_refused_as_impossible() -> None:
    model, batch = llama(16, sequence=32, width=32)
    options = dict(deterministic=True, time_limit=5, head_chunks=None)
    floor = peak_floor(optremat.plan(model, batch, 1.0, **options).graph)
    with pytest.raises(optremat.InfeasibleBudget) as refused:
        optremat.plan(model, batch, floor - 1, **options)
    assert refused.value.impossible and refused.value.floor == floor


def test_one_rank_of_fsdp_composes_its_blocks_too() -> None:
    model, batch = llama(4)
    parallel = optremat.FSDP(units=("model.layers.*",), world=2, optimizer_state=2.0)
    rmap = region_map(trace(model, batch, None), model, "cpu", parallel)
    chain = chain_of(rmap)
    assert [path for path, _ in chain.blocks] == [f"model.layers.{k}" for k in range(4)]
    budget = int(0.85 * simulate(rmap.graph, keep_all(rmap.graph)).peak_bytes)
    composed = solve_chain(chain, budget, 10, deterministic=True)
    assert composed.priced.result.peak_bytes <= budget
    assert math.isfinite(composed.bound) and composed.bound <= composed.priced.cost


def test_the_frontiers_of_one_chunk_count_serve_the_next() -> None:
    """The same step with its LM head whole and in 4 token chunks: the blocks' frontiers
    solved for the first are read from the memo for the second, whose composed plan and
    bound are those it gets solved alone."""
    model, batch = llama(4)
    chains = []
    for chunks in (None, 4):
        with running(model, chunks):
            rmap = region_map(trace(model, batch, None), model, "cpu")
        chains.append(chain_of(rmap))
    budget = int(0.8 * simulate(chains[1].rmap.graph, keep_all(chains[1].rmap.graph)).peak_bytes)
    memo, own = FrontierMemo(), FrontierMemo()
    solve_chain(chains[0], budget, 10, deterministic=True, memo=memo)
    first = set(memo.cells)
    shared = solve_chain(chains[1], budget, 10, deterministic=True, memo=memo)
    alone = solve_chain(chains[1], budget, 10, deterministic=True, memo=own)
    assert first & set(own.cells)
    assert shared.priced.cost == pytest.approx(alone.priced.cost, rel=1e-9)
    assert shared.priced.result.peak_bytes == alone.priced.result.peak_bytes <= budget
    assert shared.bound == pytest.approx(alone.bound, rel=1e-9)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 48), torch.nn.Linear(48, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def test_on_a_tiny_chain_composition_meets_every_plan_inside_the_blocks() -> None:
    """Against every plan of regions inside three small residual blocks (each block, its
    layers, their saves), at budgets from below the least peak to above most: the
    composed plan is the cheapest that fits and the bound never exceeds it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), Block(), Block(), Block(), torch.nn.Linear(16, 4))
    rmap = region_map(trace(model, torch.randn(64, 16), None), model, "cpu")
    chain = chain_of(rmap)
    assert [path for path, _ in chain.blocks] == ["1", "2", "3"]
    inner = RegionModel(rmap, [call for calls in chain.inner for call in calls])
    plans = [price(rmap, inner.chosen(values), inner.kept(values), "all") for values in every_plan(inner)]
    assert len(plans) >= 27
    peaks = sorted(p.result.peak_bytes for p in plans)
    for budget in (peaks[0] - 1, peaks[0], peaks[len(peaks) // 4], peaks[len(peaks) // 2]):
        fitting = [p.cost for p in plans if p.result.peak_bytes <= budget]
        composed = solve_chain(chain, budget, 10, deterministic=True)
        if not fitting:
            assert composed.priced is None
            continue
        assert math.isfinite(composed.bound) and composed.bound <= min(fitting) * (1 + 1e-9)
        assert composed.priced.cost == pytest.approx(min(fitting), rel=1e-9)
        assert composed.priced.result.peak_bytes <= budget
