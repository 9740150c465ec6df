"""Random module structures, written the ways people write them, planned at several
budgets: planning either refuses the budget (InfeasibleBudget) or gives a plan whose
applied model reproduces the unplanned step's loss, gradients and buffers, with a
measured peak within 2% of the budget. A few examples run by default, hundreds with
--runslow."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from hypothesis import example, given, settings
from hypothesis import strategies as st

import optremat
from optremat.runtime.measure import measure_step

WIDTH, BATCH = 32, 96
BUDGETS = (0.9, 0.7, 0.5)


class Residual(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + super().forward(x)


class Loop(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Twice(nn.Module):
    """One block called twice in a forward."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.block = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.block(x))


class Pair(nn.Module):
    """A block returning a tuple, unpacked by its caller."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.inner = _Tuple(nn.Sequential(*blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.inner(x)
        return a * 0.5 + b


class _Tuple(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.block(x), torch.tanh(x)


class Steps(nn.Module):
    """A buffer counting calls, written in place or by reassignment, that the maths reads."""

    def __init__(self, reassign: bool) -> None:
        super().__init__()
        self.reassign = reassign
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reassign:
            self.count = self.count + 1
        else:
            self.count += 1
        return torch.tanh(self.lin(x)) * (1 + 0.1 * self.count)


class Spare(nn.Module):
    """A parameter the loss never reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.spare = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def frozen() -> nn.Module:
    layer = nn.Linear(WIDTH, WIDTH)
    layer.requires_grad_(False)
    return layer


LEAVES = {
    "linear": lambda: nn.Linear(WIDTH, WIDTH),
    "mlp": lambda: nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)),
    "tanh": nn.Tanh,
    "layernorm": lambda: nn.LayerNorm(WIDTH),
    "batchnorm": lambda: nn.BatchNorm1d(WIDTH),
    "dropout": lambda: nn.Dropout(0.25),
    "frozen": frozen,
    "steps in place": lambda: Steps(reassign=False),
    "steps reassigned": lambda: Steps(reassign=True),
    "spare parameter": Spare,
}
CONTAINERS = {
    "sequential": lambda blocks: nn.Sequential(*blocks),
    "residual": lambda blocks: Residual(*blocks),
    "loop": Loop,
    "twice": Twice,
    "pair": Pair,
}

trees = st.recursive(st.sampled_from(sorted(LEAVES)),
                     lambda kids: st.tuples(st.sampled_from(sorted(CONTAINERS)), st.lists(kids, min_size=1, max_size=3)),
                     max_leaves=8)


def build(tree: Any) -> nn.Module:
    if isinstance(tree, str):
        return LEAVES[tree]()
    kind, children = tree
    return CONTAINERS[kind]([build(child) for child in children])


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def step(model: nn.Module, x: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict, dict]:
    model.load_state_dict(state)
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(3)
    loss = loss_fn(model(x))
    loss.backward()
    return (loss.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None},
            {k: b.clone() for k, b in model.named_buffers()})


def check(tree: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, WIDTH), build(tree), nn.Linear(WIDTH, 4)).double()
    x = torch.randn(BATCH, 16, dtype=torch.float64)
    state = copy.deepcopy(model.state_dict())
    want = step(model, x, state)
    for budget in BUDGETS:
        model.load_state_dict(state)
        try:
            plan = optremat.plan(model, (x,), budget, loss_fn=loss_fn, time_limit=2, deterministic=True)
        except optremat.InfeasibleBudget:
            continue
        got = step(optremat.apply(model, plan), x, state)
        torch.testing.assert_close(got[0], want[0], rtol=1e-9, atol=0, msg=f"{tree} at {budget}: the loss")
        assert got[1].keys() == want[1].keys(), f"{tree} at {budget}: which parameters get gradients"
        for name in want[1]:
            torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-9, atol=1e-12,
                                       msg=f"{tree} at {budget}: gradient of {name}")
        for name in want[2]:
            assert torch.equal(got[2][name], want[2][name]), f"{tree} at {budget}: buffer {name}"
        model.load_state_dict(state)
        measured = measure_step(model, (x,), loss_fn).peak_bytes
        assert measured <= 1.02 * plan.budget_bytes, \
            f"{tree} at {budget}: measured {measured} bytes, budget {plan.budget_bytes}, predicted {plan.predicted_peak_bytes}"
        optremat.remove(model)


@settings(max_examples=6)
@given(trees)
@example(('residual', [('twice', ['tanh']), ('pair', [('loop', ['linear']), ('residual', ['linear', 'layernorm',
                                                                                         'layernorm'])]),
                       ('loop', [('twice', ['steps reassigned', 'spare parameter']), 'steps in place'])]))
def test_random_module_structures_plan_correctly_or_refuse(tree: Any) -> None:
    check(tree)


@pytest.mark.slow
@settings(max_examples=300)
@given(trees)
def test_many_random_module_structures_plan_correctly_or_refuse(tree: Any) -> None:
    check(tree)
