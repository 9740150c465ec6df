"""One rank's memory under FSDP2 and DDP: the held bytes the simulator adds, the rank's
graph, FSDP units, and plans made for a rank."""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import optremat
from optremat import DDP, FSDP
from optremat.core.graph import Graph
from optremat.core.schedule import keep_all, recompute_all, simulate
from optremat.core.sharding import per_rank, shard_bytes, unit_of
from optremat.models import build
from optremat.planning.native import region_map
from optremat.tracing.extract import Traced, trace
from tests.dags import graphs


@functools.lru_cache(maxsize=None)
def traced(name: str) -> tuple[Traced, object]:
    example = build(name)
    return trace(example.model, example.inputs, example.loss_fn), example


def rank_of(name: str, parallel: FSDP | DDP) -> Graph:
    step, example = traced(name)
    return per_rank(step.graph, step.parameters(example.model), parallel)


@given(graph=graphs(), data=st.data())
def test_held_bytes_count_at_every_computation_of_their_stage(graph: Graph, data: st.DataObject) -> None:
    held = np.array(data.draw(st.lists(st.integers(0, 100), min_size=graph.n, max_size=graph.n)), dtype=np.int64)
    holding = replace(graph, held=held)
    for schedule in (keep_all(graph), recompute_all(graph)):
        plain, with_held = simulate(graph, schedule), simulate(holding, schedule)
        assert np.array_equal(with_held.curve, plain.curve + held[schedule.stage])
        assert with_held.cost == plain.cost


def test_held_bytes_are_part_of_the_graph_and_its_json() -> None:
    graph = Graph.build(cost=[0, 1, 1], size=[4, 8, 8], edges=[(0, 1), (1, 2)], kind=["param", "op", "op"],
                        held=[0, 5, 7])
    again = Graph.from_json(graph.to_json())
    assert again.held.tolist() == [0, 5, 7]
    assert again.fingerprint == graph.fingerprint != replace(graph, held=np.zeros(3, dtype=np.int64)).fingerprint
    with pytest.raises(optremat.GraphError, match="held"):
        Graph.build(cost=[1], size=[1], edges=[], held=[-1])


def test_a_shard_is_padded_to_whole_rows() -> None:
    graph = Graph.build(cost=[0, 0], size=[60, 12], edges=[], kind=["param", "param"],
                        tensor=["float32[5, 3]", "float32[3]"])
    assert shard_bytes(graph, 0, 2) == 3 * 3 * 4
    assert shard_bytes(graph, 0, 8) == 1 * 3 * 4
    assert shard_bytes(graph, 1, 2) == 2 * 4


def test_ddp_holds_the_unplanned_step_and_a_copy_of_every_gradient() -> None:
    step, example = traced("gpt-tiny")
    params = sum(p.numel() * p.element_size() for p in example.model.parameters())
    unplanned = simulate(step.graph, keep_all(step.graph)).peak_bytes
    for world in (2, 8):
        rank = rank_of("gpt-tiny", DDP(world=world))
        assert simulate(rank, keep_all(rank)).peak_bytes == unplanned + params
    adam = rank_of("gpt-tiny", DDP(world=2, optimizer_state=2.0))
    assert simulate(adam, keep_all(adam)).peak_bytes == unplanned + 3 * params


def test_fsdp_keeps_shards_and_a_rank_holds_less_as_ranks_are_added() -> None:
    step, example = traced("gpt-mini")
    params = [p for p, _ in step.parameters(example.model)]
    peaks = []
    for world in (1, 2, 4, 8):
        rank = rank_of("gpt-mini", FSDP(units=("blocks.*",), world=world))
        assert rank.size[params].sum() == sum(shard_bytes(step.graph, p, world) for p in params)
        assert rank.size[params].sum() <= step.graph.size[params].sum() / world + 4 * 256 * len(params)
        peaks.append(simulate(rank, keep_all(rank)).peak_bytes)
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0]
    ddp = rank_of("gpt-mini", DDP(world=2))
    assert peaks[1] < simulate(ddp, keep_all(ddp)).peak_bytes


def test_a_unit_holds_its_gathered_parameters_only_while_it_runs() -> None:
    step, example = traced("gpt-mini")
    graph = step.graph
    block = sum(p.numel() * p.element_size() for p in example.model.blocks[0].parameters())
    resharded = rank_of("gpt-mini", FSDP(units=("blocks.*",), world=2))
    kept = rank_of("gpt-mini", FSDP(units=("blocks.*",), world=2, reshard_after_forward=False))
    forward = ~graph.backward & ~graph.pinned
    loss = int(np.nonzero(forward)[0][-1])
    assert kept.held[loss] - resharded.held[loss] == 4 * block
    units = unit_of(graph, ("blocks.*",))
    inside = np.nonzero(forward & (units == 1))[0]
    assert resharded.held[inside[1:]].min() >= resharded.held[loss] + block


def test_a_group_of_modules_is_one_unit_gathered_from_its_forward_through_its_backward() -> None:
    """gpt-mini's final norm and head sharded together (its head's weight is the token
    embedding's, which stays the root's): while block 0 runs, the group's parameters are
    not gathered, where the root's would be; at the loss both hold them."""
    step, example = traced("gpt-mini")
    graph = step.graph
    tail = sum(p.numel() * p.element_size() for name, p in example.model.named_parameters()
               if name.startswith(("ln.", "head.")))
    rooted = rank_of("gpt-mini", FSDP(units=("blocks.*",), world=2))
    grouped = rank_of("gpt-mini", FSDP(units=("blocks.*",), world=2, groups=(("ln", "head"),)))
    units = unit_of(graph, ("blocks.*",), (("ln", "head"),))
    by_module = {module: int(unit) for module, unit in zip(graph.module, units)}
    assert by_module["ln"] == by_module["head"] not in {by_module[""], by_module["blocks.0"], by_module["blocks.3"]}
    forward = ~graph.backward & ~graph.pinned
    loss = int(np.nonzero(forward)[0][-1])
    inside = np.nonzero(forward & (units == by_module["blocks.0"]))[0]
    assert tail > 0 and set((rooted.held - grouped.held)[inside[1:]].tolist()) == {tail}
    assert rooted.held[loss] == grouped.held[loss]


def test_units_match_one_path_component_per_star_and_the_innermost_wins() -> None:
    graph = Graph.build(cost=[1] * 5, size=[1] * 5, edges=[],
                        module=["tok", "blocks.0.attn.qkv", "blocks.0.mlp.0", "blocks.1", "blocks"])
    assert unit_of(graph, ("blocks.*",)).tolist() == [0, 1, 1, 2, 0]
    assert unit_of(graph, ("blocks.*", "blocks.0.mlp")).tolist() == [0, 1, 2, 3, 0]


def test_a_unit_or_group_pattern_matching_no_module_is_refused_before_tracing() -> None:
    """FSDP(units=("nonexistent.*",)) was planned as a job sharding the root only, where
    wrapping the model then refused the same pattern."""
    example = build("gpt-tiny")
    for parallel in (FSDP(units=("blocks.*", "block.*"), world=2), FSDP(groups=(("lm_head", "norm"),), world=2)):
        with pytest.raises(ValueError, match=r"no module of GPT matches the FSDP units \['"):
            optremat.plan(example.model, example.inputs, 1.0, loss_fn=example.loss_fn, parallel=parallel)


def test_under_fsdp_no_region_spans_two_units() -> None:
    step, example = traced("mlp-tiny")
    units = ("*",)
    plain = region_map(step, example.model, "cpu")
    sharded = region_map(step, example.model, "cpu", FSDP(units=units, world=2))
    unit = unit_of(sharded.graph, units)

    def spanning(rmap) -> list:
        return [call for structure in rmap.structures() for call in structure
                if len(set(unit[rmap.members[call]].tolist())) > 1]

    assert spanning(plain) and not spanning(sharded)
    assert sharded.structures()


def test_a_plan_for_one_rank_is_priced_for_that_rank_and_saved_with_its_sharding(tmp_path) -> None:
    example = build("gpt-tiny")
    parallel = FSDP(units=("blocks.*",), world=4)
    made = optremat.plan(example.model, example.inputs, 1.0, loss_fn=example.loss_fn, parallel=parallel,
                         time_limit=2)
    rank = rank_of("gpt-tiny", parallel)
    assert made.baseline_peak_bytes == simulate(rank, keep_all(rank)).peak_bytes == made.predicted_peak_bytes
    assert "per rank: FSDP2 over 4 ranks" in made.summary()
    made.save(tmp_path / "plan.json")
    assert optremat.Plan.load(tmp_path / "plan.json").parallel == parallel
    cache = tmp_path / "cache"
    for world in (4, 8):
        again = optremat.plan(example.model, example.inputs, 0.9, loss_fn=example.loss_fn, time_limit=2,
                              parallel=replace(parallel, world=world), cache=cache)
        assert not again.cached and again.parallel.world == world


def test_a_plan_for_one_rank_needs_its_world() -> None:
    example = build("gpt-tiny")
    with pytest.raises(ValueError, match="number of ranks"):
        optremat.plan(example.model, example.inputs, 0.9, parallel=FSDP(units=("blocks.*",)))
    with pytest.raises(TypeError, match="FSDP or optremat.DDP"):
        optremat.plan(example.model, example.inputs, 0.9, parallel="fsdp")
