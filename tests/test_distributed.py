"""Data-parallel training under a plan, on two local CPU processes (gloo): FSDP2 and DDP,
on the built-in gpt-mini and on a transformers Llama, give the single-process step's
gradients, each rank's measured peak stays within its budget and near the predicted one,
and every rank runs the same decisions."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import optremat
from optremat import DDP, FSDP
from optremat.distributed import run_local, wrap
from optremat.distributed.agree import PlanningFailed
from optremat.distributed.trial import RankStep, gradients_of, rank_peak, run, whole_gradients
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


@pytest.mark.slow
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


def hf_llama() -> tuple[torch.nn.Module, torch.Tensor]:
    """transformers' Llama from its config: tied embeddings, sdpa, a dataclass output."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128, use_cache=False,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    return LlamaForCausalLM(config), torch.randint(0, 1000, (4, 128), generator=torch.Generator().manual_seed(1))


def next_token_loss(tokens: torch.Tensor):
    return lambda out: F.cross_entropy(out.logits.flatten(0, 1), tokens.flatten())


def hf_llama_rank(parallel: FSDP | DDP) -> tuple[int, int, int, str, dict | None]:
    """One rank of `parallel` stepping a transformers Llama on its share of the batch, its
    loss computed outside the model: (budget, predicted peak, measured peak, decisions,
    rank 0's whole gradients)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, tokens = hf_llama()
    mine = tokens.chunk(world)[rank].contiguous()
    loss_fn = next_token_loss(mine)
    made = optremat.distributed.plan(model, (mine,), 0.8, parallel, loss_fn=loss_fn, time_limit=2)
    optremat.apply(model, made)
    wrapped = wrap(model, made.parallel)

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        out = wrapped(mine)
        loss_fn(out).backward()

    step()
    peak = rank_peak(model, wrapped, mine, step)
    gradients = whole_gradients(model)
    decisions = repr([r.to_json() for r in made.regions])
    return made.budget_bytes, made.predicted_peak_bytes, peak, decisions, gradients if rank == 0 else None


@pytest.mark.parametrize("parallel", [pytest.param(FSDP(units=("model.layers.*",)), marks=pytest.mark.slow),
                                      pytest.param(DDP(), marks=pytest.mark.slow)])
def test_a_transformers_llama_under_a_per_rank_plan(parallel: FSDP | DDP) -> None:
    pytest.importorskip("transformers")
    ranks = run_local(hf_llama_rank, WORLD, parallel)
    model, tokens = hf_llama()
    next_token_loss(tokens)(model(tokens)).backward()
    assert ranks[0][3] == ranks[1][3] != "[]"
    for budget, predicted, measured, _, _ in ranks:
        assert measured <= 1.05 * budget and abs(measured - predicted) <= 0.10 * predicted, (budget, predicted, measured)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(ranks[0][4][name], p.grad.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)


def hf_llama_own_loss_rank() -> tuple[int, int, int, int | None, bool, dict]:
    """One FSDP2 rank stepping a transformers Llama on its share of the batch with its own
    loss (`labels`), the LM head left to the plan: (budget, predicted peak, measured
    peak, the head's chunks, whether the output's logits were None, whole gradients)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, tokens = hf_llama()
    mine = tokens.chunk(world)[rank].contiguous()
    batch = {"input_ids": mine, "labels": mine}
    made = optremat.distributed.plan(model, batch, 0.6, FSDP(units=("model.layers.*",)), time_limit=1,
                                     deterministic=True)
    optremat.apply(model, made)
    wrapped = wrap(model, made.parallel)
    outputs = []

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        outputs.append(wrapped(**batch))
        outputs[-1].loss.backward()

    step()
    peak = rank_peak(model, wrapped, batch, step)
    return (made.budget_bytes, made.predicted_peak_bytes, peak, made.chunking.chunks, outputs[0].logits is None,
            whole_gradients(model))


def test_a_transformers_llama_with_its_head_chunked_under_fsdp2() -> None:
    """Below what its whole head allows, each FSDP2 rank runs the Llama's head and loss
    in token chunks inside the model's forward (the root unit's weights gathered once
    for the whole chunk loop): the mean of the ranks' losses has the single process's
    gradients, and each rank's peak is near its prediction."""
    pytest.importorskip("transformers")
    ranks = run_local(hf_llama_own_loss_rank, WORLD)
    model, tokens = hf_llama()
    (sum(model(input_ids=half, labels=half).loss for half in tokens.chunk(WORLD)) / WORLD).backward()
    for budget, predicted, measured, chunks, no_logits, _ in ranks:
        assert chunks is not None and no_logits
        assert measured <= 1.05 * budget and abs(measured - predicted) <= 0.10 * predicted, (budget, predicted, measured)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(ranks[0][5][name], p.grad.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)


def head_sharded_rank(grouped: bool) -> tuple[bool, bool, dict]:
    """One FSDP2 rank running a transformers Llama's own loss with its head planned in 4
    chunks, the head sharded with the final norm (`grouped`, as accelerate shards them) or
    alone: whether a warning said the head runs whole, whether the logits came back None,
    and the whole gradients."""
    from torch.distributed.fsdp import fully_shard

    model, tokens = hf_llama()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    batch = {"input_ids": tokens, "labels": tokens}
    optremat.apply(model, optremat.plan(model, batch, 1.0, head_chunks=4, time_limit=1, deterministic=True))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard([model.model.norm, model.lm_head] if grouped else model.lm_head, reshard_after_forward=False)
    fully_shard(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = model(**batch)
        outputs.loss.backward()
    whole = any("run whole" in str(w.message) for w in caught)
    return whole, outputs.logits is None, whole_gradients(model)


@pytest.mark.parametrize("grouped", [True, False])
def test_a_head_fsdp2_gathers_with_the_final_norm_runs_in_chunks_and_one_sharded_alone_whole(grouped: bool) -> None:
    """FSDP2 completes a group some module of which never ran its forward, so a head
    sharded in one group with the final norm (gathered as the norm runs) runs in chunks;
    a head sharded alone would never be gathered, and runs whole, with a warning. Both
    give the unsharded model's gradients."""
    pytest.importorskip("transformers")
    (whole, no_logits, gradients), = run_local(head_sharded_rank, 1, grouped)
    assert whole != grouped and no_logits == grouped
    model, tokens = hf_llama()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model(input_ids=tokens, labels=tokens).loss.backward()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(gradients[name], p.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def replanning_rank() -> tuple[str, str]:
    """One DDP rank replanning at a new batch size: first the same size on both ranks, then
    rank 1 at another: (the new shape's regions, the warning at the mismatched shape)."""
    import warnings

    rank = dist.get_rank()
    example = build("gpt-tiny")
    loss_fn = lambda out: out.square().mean()  # noqa: E731 - the same loss at every batch size
    made = optremat.distributed.plan(example.model, example.inputs, 0.95, DDP(), loss_fn=loss_fn, time_limit=1)
    replan = optremat.Replanning(0.95, loss_fn=loss_fn, time_limit=1)
    optremat.apply(example.model, made, replan=replan)
    tokens = example.inputs[0]
    example.model(torch.cat([tokens, tokens]))
    (regions,) = [p.regions for key, p in replan.plans.items() if p is not made]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        example.model(tokens[:1 + rank])
    return repr([r.to_json() for r in regions]), " ".join(str(w.message) for w in caught)


def test_replanning_under_a_process_group_plans_every_rank_alike() -> None:
    first, second = run_local(replanning_rank, WORLD)
    assert first[0] == second[0]
    assert "rank 1 on int64[2, 32]" in first[1] and "rank 0 on int64[1, 32]" in second[1]
