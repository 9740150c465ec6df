"""Module trees as people write them, through the public API: nested Sequentials, a module
called twice, residual wrappers, ModuleList loops, blocks returning tuples, a module listed
twice in a Sequential, recurrent layers, parameters the loss never reaches, buffers a
forward reassigns. At every budget a plan is made and trains exactly as the model does,
or planning says that nothing fits."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import optremat
from tests.blocks import Twice

Loss = Callable[[Any], torch.Tensor]


def square_mean(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def mlp(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


class Residual(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


class Loop(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Pair(nn.Module):
    """Returns a tuple, which its caller unpacks."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate = mlp(width)
        self.value = mlp(width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.sigmoid(self.gate(x)), self.value(x)


class Gated(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.pair = Pair(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.pair(x)
        return gate * value


def nested_sequentials() -> nn.Module:
    return nn.Sequential(*[mlp(16) for _ in range(4)], nn.Linear(16, 4))


def called_twice() -> nn.Module:
    return nn.Sequential(Twice(mlp(16)), Twice(Residual(mlp(16))), nn.Linear(16, 4))


def residual_loop() -> nn.Module:
    return nn.Sequential(Loop([Residual(mlp(16)) for _ in range(4)]), nn.Linear(16, 4))


def tuple_blocks() -> nn.Module:
    return nn.Sequential(Gated(16), Gated(16), nn.Linear(16, 4))


def three_deep() -> nn.Module:
    return nn.Sequential(nn.Sequential(nn.Sequential(mlp(16), mlp(16)), nn.Sequential(mlp(16), nn.GELU())),
                         Residual(nn.Sequential(mlp(16), mlp(16))), nn.Linear(16, 4))


def listed_twice() -> nn.Module:
    shared = mlp(16)
    return nn.Sequential(nn.Sequential(shared, mlp(16), shared), mlp(16), nn.Linear(16, 4))


def trains_as_planned(model: nn.Module, inputs: tuple, budgets: tuple[float, ...], loss_fn: Loss | None,
                      loss: Loss) -> list[optremat.Plan]:
    """The plans made at `budgets` (InfeasibleBudget where nothing fits): each fits its
    budget, and the model applied with it computes `loss` and its gradients exactly as
    the unplanned model does. Planning leaves the model's own tensors in place."""
    reference = copy.deepcopy(model)
    want_loss, want = loss_and_gradients(reference, inputs, loss)
    before = [id(t) for t in [*model.parameters(), *model.buffers()]]
    plans = []
    for budget in budgets:
        try:
            plan = optremat.plan(model, inputs, budget, loss_fn=loss_fn, time_limit=1, deterministic=True)
        except optremat.InfeasibleBudget:
            continue
        assert [id(t) for t in [*model.parameters(), *model.buffers()]] == before
        assert plan.predicted_peak_bytes <= plan.budget_bytes
        got_loss, got = loss_and_gradients(optremat.apply(copy.deepcopy(model), plan), inputs, loss)
        assert torch.equal(got_loss, want_loss)
        for g, w in zip(got, want, strict=True):
            assert (g is None and w is None) or torch.equal(g, w)
        plans.append(plan)
    return plans


def loss_and_gradients(model: nn.Module, inputs: tuple, loss: Loss) -> tuple[torch.Tensor, tuple]:
    """One step's loss and gradients (None for a parameter the loss never reaches), random
    ops drawing the same numbers each time."""
    torch.manual_seed(0)
    value = loss(model(*inputs))
    return value, torch.autograd.grad(value, list(model.parameters()), allow_unused=True)


@pytest.mark.parametrize("batch", [64, 1024])
def test_a_sequential_of_sequentials_plans_at_every_budget(batch: int) -> None:
    """At batch 64 parameters and gradients make the peak, so that no plan lowers it; at
    1024 activations do, down to 70% of it at least."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(6)],
                          nn.Linear(256, 10))
    plans = trains_as_planned(model, (torch.randn(batch, 256),), (0.9, 0.7, 0.5), square_mean, square_mean)
    assert len(plans) >= (0 if batch == 64 else 2) and all(plan.regions for plan in plans)


@pytest.mark.parametrize("build", [nested_sequentials, called_twice, residual_loop, tuple_blocks, three_deep,
                                   listed_twice])
def test_module_trees_plan_and_train_exactly(build: Callable[[], nn.Module]) -> None:
    torch.manual_seed(0)
    model = build().double()
    inputs = (torch.randn(512, 16, dtype=torch.float64),)
    plans = trains_as_planned(model, inputs, (0.9, 0.6), square_mean, square_mean)
    assert any(plan.regions for plan in plans), "some budget checkpoints something"


class Recurrent(nn.Module):
    """An LSTM between two MLPs, returning its output and its final state (in float32, as
    the CPU's oneDNN kernels run it, whose backward returns one tensor twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Linear(128, 16))
        self.lstm = nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.post = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        out, (h, c) = self.lstm(self.pre(x))
        return self.post(out), (h, c)


@pytest.mark.parametrize("loss_fn", [lambda o: o[0].sum(), lambda o: o[0].square().mean(), lambda o: o[1][0].sum(),
                                     None], ids=["out-sum", "out-square", "h-sum", "no-loss-fn"])
def test_an_lstm_plans_whatever_the_loss_reads(loss_fn: Loss | None) -> None:
    torch.manual_seed(0)
    model = Recurrent()
    inputs = (torch.randn(8, 24, 16),)
    assert trains_as_planned(model, inputs, (0.9,), loss_fn, loss_fn or (lambda o: o[0].square().mean()))


def test_a_parameter_the_loss_never_reaches_is_planned_without_a_gradient() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=64, use_cache=False)
    model = transformers.BertModel(config).train()
    loss = lambda out: out.last_hidden_state.square().mean()  # noqa: E731 - the pooler gets no gradient
    plans = trains_as_planned(model, (torch.randint(0, 64, (8, 64)),), (0.9,), loss, loss)
    assert plans and plans[0].regions


class TwoHeads(nn.Module):
    """Returns a dict; without a loss function the plan prices a loss over the larger
    output, which the small head's parameters never reach."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(mlp(16), mlp(16))
        self.logits = nn.Linear(16, 64)
        self.score = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(x)
        return {"logits": self.logits(h), "score": self.score(h)}


def test_a_dict_output_without_a_loss_fn_plans() -> None:
    torch.manual_seed(0)
    model = TwoHeads().double()
    inputs = (torch.randn(512, 16, dtype=torch.float64),)
    plans = trains_as_planned(model, inputs, (0.9,), None,
                              lambda out: out["logits"].logsumexp(-1).mean() + out["score"].square().mean())
    assert plans and plans[0].regions


class Counted(nn.Module):
    """Counts its calls in a buffer it reassigns, not writes in place."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = mlp(width)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return self.mlp(x)


def test_a_reassigned_buffer_changes_once_per_step_when_its_module_reruns() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Counted(16) for _ in range(4)], nn.Linear(16, 4)).double()
    inputs = (torch.randn(512, 16, dtype=torch.float64),)
    plan = optremat.plan(model, inputs, 0.6, loss_fn=square_mean, time_limit=1, deterministic=True)
    assert {f"{k}.calls" for k in range(4)} <= set(plan.mutated_buffers)
    assert plan.regions
    trained = optremat.apply(copy.deepcopy(model), plan)
    square_mean(trained(*inputs)).backward()
    assert [int(block.calls) for block in trained[:4]] == [1, 1, 1, 1]


@pytest.mark.slow
def test_a_causal_lm_planned_without_a_loss_fn_fits_its_budget_under_the_usual_shifted_loss() -> None:
    """GPT-2's loss written after the model, `cross_entropy(logits[:, :-1].reshape(-1, V)
    .float(), ids[:, 1:].reshape(-1))` (the output not held through the backward): the
    assumed loss prices what it holds, so the measured step fits the plan's budget."""
    transformers = pytest.importorskip("transformers")
    from optremat.runtime.measure import measure_step

    torch.manual_seed(0)
    vocab = 5000
    config = transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=2, n_positions=128,
                                     use_cache=False, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, vocab, (8, 128))

    def shifted(out: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, vocab).float(), ids[:, 1:].reshape(-1))

    for budget in (0.95, 0.87):  # its least peak is 0.848 of the unplanned
        plan = optremat.plan(model, (ids,), budget, time_limit=2, deterministic=True)
        assert "not given" in plan.summary()
        optremat.apply(model, plan)
        measured = measure_step(model, (ids,), shifted).peak_bytes
        optremat.remove(model)
        assert measured <= 1.02 * plan.budget_bytes, (budget, measured, plan.summary())


class KeyedBlocks(nn.Module):
    """Two plain blocks, then blocks in an nn.ModuleDict under `keys`, run in turn with residuals."""

    def __init__(self, keys: list[str]) -> None:
        super().__init__()
        self.keys = keys
        self.first = nn.ModuleList(mlp(32) for _ in range(2))
        self.blocks = nn.ModuleDict({key: mlp(32) for key in keys})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.first, *(self.blocks[key] for key in self.keys)]:
            x = x + block(x)
        return x


@pytest.mark.parametrize("keys", [["layer[1]", "layer[2]"], ["blk[0:2]", "blk[2:4]"]])
def test_modules_named_with_brackets_are_never_checkpointed_and_a_refusal_says_why(keys: list[str]) -> None:
    """Plans write runs of a Sequential's children as `path[a:b]`; a module whose name
    holds brackets (an nn.ModuleDict key PyTorch accepts) is left out of plans, which
    checkpoint the rest and train as unplanned, and a budget only it could meet is
    refused naming it."""
    torch.manual_seed(0)
    model = KeyedBlocks(keys)
    x = torch.randn(512, 32)
    want = torch.autograd.grad(square_mean(model(x)), list(model.parameters()))
    with pytest.raises(optremat.InfeasibleBudget, match="a module named with brackets") as refused:
        optremat.plan(model, x, 0.3, loss_fn=square_mean, time_limit=5)
    plan = optremat.plan(model, x, refused.value.smallest, loss_fn=square_mean, time_limit=5, deterministic=True)
    assert plan.regions and all("[" not in region.path for region in plan.regions)
    optremat.apply(model, plan)
    for got, wanted in zip(torch.autograd.grad(square_mean(model(x)), list(model.parameters())), want):
        torch.testing.assert_close(got, wanted, rtol=0, atol=0)
