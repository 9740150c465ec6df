"""Models planned as their users train them: batches as dicts (`model(**batch)`), positional
and keyword arguments together, and the loss a transformers model computes itself from
`labels`."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import optremat
from optremat.runtime.measure import measure_peak

transformers = pytest.importorskip("transformers")


def gpt2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=2000, n_embd=64, n_layer=3, n_head=4, n_positions=128,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 2000, (4, 128))
    return transformers.GPT2LMHeadModel(config).train(), {"input_ids": ids, "labels": ids}


def own_loss_step(model: nn.Module, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """A step as a Trainer takes it: the model's own loss from `labels`, dropout seeded."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(5)
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters()}


def planned_step_is_exact(model: nn.Module, batch: dict) -> optremat.Plan:
    """Plan `model` on `batch` at 0.7 without a loss_fn, its LM head whole, and apply it: the
    applied step's loss and gradients equal the unplanned step's bitwise (a head in chunks
    sums the loss in another order: tests/test_hf_chunked.py); the plan, which
    checkpoints something."""
    state = copy.deepcopy(model.state_dict())
    want = own_loss_step(model, batch)
    plan = optremat.plan(model, batch, 0.7, time_limit=1, deterministic=True, head_chunks=None)
    assert plan.regions
    optremat.apply(model, plan)
    model.load_state_dict(state)
    got = own_loss_step(model, batch)
    assert got[0] == want[0]
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=0, atol=0, msg=name)
    return plan


def test_a_dict_batch_with_labels_plans_the_models_own_loss() -> None:
    model, batch = gpt2()
    plan = planned_step_is_exact(model, batch)
    assert "the model's own" in plan.summary()
    params = list(model.parameters())

    def step() -> tuple:
        out = model(**batch)
        return torch.autograd.grad(out.loss, params)

    step()
    measured = measure_peak(step, resident=[params, list(model.buffers()), list(batch.values())]).peak_bytes
    assert measured <= 1.02 * plan.budget_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * plan.predicted_peak_bytes


class NanoGPT(nn.Module):
    """A language model computing its loss in its forward from `targets`, returning
    `logits, loss` as nanoGPT does; with `aux`, another scalar instead: one computed apart
    from the logits ("router", as a mixture of experts' load-balancing loss is returned
    beside its output) or from them by no loss function ("z-loss")."""

    def __init__(self, aux: str | None = None) -> None:
        super().__init__()
        self.aux = aux
        self.embed = nn.Embedding(512, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                                    for _ in range(4))
        self.head = nn.Linear(64, 512, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple:
        x = self.embed(idx)
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x)
        if self.aux == "router":
            return logits, x.square().mean()
        if self.aux == "z-loss":
            return logits, logits.logsumexp(-1).square().mean()
        loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def test_logits_and_a_loss_computed_from_them_plan_the_models_own_loss() -> None:
    """nanoGPT's `logits, loss = model(idx, targets)` was priced with a cross-entropy assumed
    over the logits, its own loss left out of the backward: its plan now prices the step
    its users run, `loss.backward()`, as a loss_fn reading it would, and runs as priced
    (with the head whole here: tests/test_deferred_head.py runs it in chunks)."""
    torch.manual_seed(0)
    model = NanoGPT()
    idx, targets = torch.randint(0, 512, (8, 128)), torch.randint(0, 512, (8, 128))
    targets[:, :3] = -1
    plan = optremat.plan(model, (idx, targets), 0.6, head_chunks=None, time_limit=5, deterministic=True)
    given = optremat.plan(model, (idx, targets), plan.budget_bytes, loss_fn=lambda out: out[1], time_limit=5,
                          deterministic=True)
    assert "the model's own" in plan.summary()
    assert plan.graph.fingerprint == given.graph.fingerprint and plan.graph.total_cost == given.graph.total_cost
    assert plan.regions and plan.predicted_peak_bytes == given.predicted_peak_bytes
    params = list(model.parameters())
    want = torch.autograd.grad(model(idx, targets)[1], params)
    optremat.apply(model, plan)

    def step() -> tuple:
        logits, loss = model(idx, targets)  # the logits held through the backward, as nanoGPT's loop holds them
        return torch.autograd.grad(loss, params)

    for got, wanted in zip(step(), want):
        torch.testing.assert_close(got, wanted, rtol=0, atol=0)
    measured = measure_peak(step, resident=[params, list(model.buffers()), [idx, targets]]).peak_bytes
    assert measured <= 1.02 * plan.budget_bytes
    assert abs(measured - plan.predicted_peak_bytes) <= 0.05 * plan.predicted_peak_bytes


@pytest.mark.parametrize("aux", ["router", "z-loss"])
def test_a_scalar_beside_the_logits_that_no_loss_function_made_from_them_is_not_taken_for_the_loss(aux: str) -> None:
    torch.manual_seed(0)
    plan = optremat.plan(NanoGPT(aux=aux), (torch.randint(0, 512, (8, 128)),), 0.8, time_limit=5,
                         deterministic=True)
    assert "not given: priced as a cross-entropy" in plan.summary()


class Masked(nn.Module):
    """A model taking a tensor positionally and a mask and a flag by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                                    for _ in range(4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x) * mask * scale
        return x


def test_positional_and_keyword_arguments_plan_together_and_replan_by_keyword_shapes() -> None:
    torch.manual_seed(0)
    model = Masked().double()
    x, mask = torch.randn(512, 64, dtype=torch.float64), torch.rand(512, 1, dtype=torch.float64)
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    want = torch.autograd.grad(loss_fn(model(x, mask=mask, scale=2.0)), list(model.parameters()))
    plan = optremat.plan(model, optremat.Inputs(x, mask=mask, scale=2.0), 0.7, loss_fn=loss_fn, time_limit=5,
                         deterministic=True)
    replan = optremat.Replanning(0.7, loss_fn=loss_fn, time_limit=5)
    optremat.apply(model, plan, replan=replan)
    got = torch.autograd.grad(loss_fn(model(x, scale=2.0, mask=mask)), list(model.parameters()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=0)
    assert list(replan.plans.values()) == [plan], "the same call with keywords in another order planned again"
    model(x[:256], mask=mask[:256], scale=2.0)
    assert len(replan.plans) == 2


class Tokenizer:
    """An object a batch may carry that no trace can take."""


def test_an_input_the_tracer_cannot_take_names_the_argument() -> None:
    model, batch = gpt2()
    with pytest.raises(optremat.ExtractionError, match="example input tokenizer is a Tokenizer"):
        optremat.plan(model, {**batch, "tokenizer": Tokenizer()}, 0.7, time_limit=5)
