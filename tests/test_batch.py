"""Max-batch search: graphs at any batch size from two traces, and the search itself."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from optremat import extract, keep_all, simulate
from optremat.models import build
from optremat.planners.batch import graph_at, max_batch
from optremat.planning.batch import batch_ways
from tests import console
from tests.console import Ran


def traced(name: str, batch: int):
    example = build(name, batch=batch)
    return extract(example.model, example.inputs, example.loss_fn)


@pytest.mark.parametrize("name", ["gpt-tiny", "resnet-tiny"])
def test_graph_at_a_batch_matches_tracing_at_that_batch(name: str) -> None:
    """Traced at 2 and 3: at batch 1 a CPU runs a float32 convolution in another kernel."""
    at = graph_at(traced(name, 2), traced(name, 3), 2, 3)
    want = traced(name, 5)
    got = at(5)
    assert np.array_equal(got.size, want.size) and np.array_equal(got.workspace, want.workspace)
    np.testing.assert_allclose(got.cost, want.cost, rtol=0.2)
    assert simulate(got, keep_all(got)).peak_bytes == simulate(want, keep_all(want)).peak_bytes


def test_max_batch_finds_the_boundary_planning_fits_more_and_a_way_that_holds_less_more_still() -> None:
    """The largest unplanned batch is the boundary, a plan fits more; a way of running the
    step that holds half the bytes for 5% more compute, planned too, is taken where the
    step as given no longer fits, and named."""
    at = graph_at(traced("gpt-tiny", 1), traced("gpt-tiny", 2), 1, 2)
    memory = 4 * 2**20
    # The limit is deterministic time; and `auto` never returns worse than the heuristics'
    # plan, which already fits more than the unplanned batch, so no limit flips the result.
    alone = max_batch(at, memory, max_overhead=0.25, time_limit=0.02, deterministic=True)
    peak = lambda b: simulate(at(b), keep_all(at(b))).peak_bytes  # noqa: E731
    assert peak(alone.unplanned) <= memory < peak(alone.unplanned + 1)
    assert alone.planned > alone.unplanned and alone.planned_overhead <= 0.25
    assert alone.ratio == alone.planned / alone.unplanned

    def half(batch: int):
        graph = at(batch)
        return replace(graph, size=graph.size // 2, cost=graph.cost * 1.05)

    both = max_batch(at, memory, max_overhead=0.25, time_limit=0.02, deterministic=True, alternatives=[("half", half)])
    assert both.unplanned == alone.unplanned and both.planned > alone.planned
    assert both.planned_with == "half" and 0.05 - 1e-9 <= both.planned_overhead <= 0.25


def test_cli_max_batch() -> None:
    def run(*args: str) -> Ran:
        return console.run("max-batch", "--model", "gpt-tiny", *args)

    result = run("--memory", "4MiB", "--time-limit", "0.02", "--deterministic", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["planned_batch"] >= report["unplanned_batch"] > 0
    bad = run("--memory", "lots")
    assert bad.returncode == 2 and "memory size" in bad.stderr and bad.stderr.strip().count("\n") == 0


@pytest.mark.slow
def test_cli_max_batch_prices_the_head_in_chunks() -> None:
    result = console.run("max-batch", "--model", "gpt-tiny", "--memory", "4MiB", "--time-limit", "0.1",
                         "--deterministic", "--head-chunks", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["planned_batch"] >= report["unplanned_batch"] > 0 and "planned_with" in report


def test_cli_max_batch_head_chunks_are_for_gpts() -> None:
    bad = console.run("max-batch", "--model", "resnet-tiny", "--memory", "4MiB", "--head-chunks")
    assert bad.returncode == 2 and "--head-chunks is for the built-in GPTs" in bad.stderr


def test_a_gpts_ways_are_its_head_whole_and_in_each_chunk_count() -> None:
    """`batch_ways` traces the head whole, then in each count priced (gpt-tiny's 64 tokens
    at batch 2 make chunks of 16 in four); each way's graph at a batch not traced is the
    one traced there."""
    ways = dict(batch_ways("gpt-tiny", head_chunks=True))
    assert list(ways) == ["", "2 chunks", "4 chunks"]
    example = build("gpt-tiny", batch=5, head_in_loss=True)
    want = extract(example.model, example.inputs, example.loss_fn.with_chunks(2))
    got = ways["2 chunks"](5)
    assert simulate(got, keep_all(got)).peak_bytes == simulate(want, keep_all(want)).peak_bytes
