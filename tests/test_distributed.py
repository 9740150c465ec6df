"""Data-parallel training under a plan, on two local CPU processes (gloo): FSDP2 and DDP
give the single-process step's gradients, each rank's measured peak stays within its
budget and near the predicted one, and every rank runs the same decisions."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch.distributed as dist

import optremat
from optremat import DDP, FSDP
from optremat.distributed import run_local
from optremat.distributed.agree import PlanningFailed
from optremat.distributed.trial import RankStep, gradients_of, run
from optremat.models import build

MODEL, BATCH, WORLD = "gpt-mini", 2, 2
"""gpt-mini at two samples per rank on two ranks: one batch of four."""


@functools.lru_cache(maxsize=None)
def reference() -> dict[str, np.ndarray]:
    return gradients_of(MODEL, WORLD * BATCH)


def check(steps: list[RankStep]) -> None:
    expected = reference()
    assert len(steps) == WORLD
    assert all(step.decisions == steps[0].decisions for step in steps)
    assert steps[0].decisions != "[]", "the budget should make the plan checkpoint something"
    for step in steps:
        assert step.measured_peak_bytes <= 1.05 * step.budget_bytes, step
        assert abs(step.measured_peak_bytes - step.predicted_peak_bytes) <= 0.10 * step.predicted_peak_bytes, step
    gradients = steps[0].gradients
    assert gradients.keys() == expected.keys()
    for name, grad in expected.items():
        np.testing.assert_allclose(gradients[name], grad, rtol=1e-5, atol=1e-5, err_msg=name)


def test_fsdp2_step_under_a_per_rank_plan() -> None:
    check(run(MODEL, BATCH, 0.75, FSDP(units=("blocks.*",)), WORLD, time_limit=1.0))


def test_ddp_step_under_a_per_rank_plan() -> None:
    check(run(MODEL, BATCH, 0.85, DDP(), WORLD, time_limit=1.0))


@pytest.mark.slow
@pytest.mark.parametrize("parallel,budget", [
    (FSDP(units=("blocks.*",)), 0.85), (FSDP(units=("blocks.*",), reshard_after_forward=False), 0.8),
    (DDP(), 0.9)])
def test_more_budgets_and_sharding_options(parallel: FSDP | DDP, budget: float) -> None:
    check(run(MODEL, BATCH, budget, parallel, WORLD, time_limit=5.0))


def disagreeing_ranks() -> list[str]:
    """Rank 1 plans at another batch size; then rank 0 is given a budget nothing fits."""
    rank = dist.get_rank()
    failures = []
    example = build("gpt-tiny", batch=2 + rank)
    try:
        optremat.distributed.plan(example.model, example.inputs, 0.9, DDP(), loss_fn=example.loss_fn)
    except optremat.PlanMismatch as error:
        failures.append(str(error))
    example = build("gpt-tiny")
    try:
        optremat.distributed.plan(example.model, example.inputs, 1000, DDP(), loss_fn=example.loss_fn)
    except (optremat.InfeasibleBudget, ValueError, PlanningFailed) as error:
        failures.append(f"{type(error).__name__}: {error}")
    return failures


def test_ranks_that_disagree_get_a_clear_error_on_every_rank() -> None:
    first, second = run_local(disagreeing_ranks, WORLD)
    assert len(first) == len(second) == 2
    assert all("rank 1 differs from rank 0 in its input shapes" in f for f in (first[0], second[0]))
    assert first[1].startswith("ValueError") and "below" in first[1]
    assert second[1].startswith("PlanningFailed") and "ValueError" in second[1]


def test_planning_outside_a_process_group_says_how_to_plan_one_rank() -> None:
    example = build("gpt-tiny")
    with pytest.raises(RuntimeError, match="init_process_group"):
        optremat.distributed.plan(example.model, example.inputs, 0.9, DDP())
