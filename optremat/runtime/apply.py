"""`apply(model, plan)` and `remove(model)`: a model trained under a plan, and back."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from optremat.budget import check_budget
from optremat.extract import tensor_type
from optremat.plan import Plan
from optremat.planning import plan as make_plan
from optremat.regions import Region
from optremat.runtime import native
from optremat.solve import SOLVERS

log = logging.getLogger("optremat")


@dataclass(eq=False)
class Replanning:
    """Plan again on the first training step at each new input shape (batch size,
    sequence length), at `budget`: bytes or a size hold for every shape, a fraction is of
    each shape's unplanned peak; None keeps the applied plan's budget in bytes. The other
    fields are `plan()`'s; with `cache`, a shape planned once loads in later runs. A shape
    no plan fits runs the plan applied, with a warning naming the smallest budget.
    `plans` holds the plan made for each shape, by its inputs' tensor types."""

    budget: int | float | str | None = None
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    cache: str | Path | None = None
    solver: str = "auto"
    time_limit: float = 30.0
    plans: dict[tuple[str, ...], Plan] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.budget is not None:
            check_budget(self.budget)
        if self.solver not in SOLVERS:
            raise ValueError(f"unknown solver {self.solver!r}; choose one of {', '.join(SOLVERS)}")

    def chooser(self, model: nn.Module, applied: Plan) -> native.Choose:
        """What picks the regions of `model`'s forward for its inputs, `applied` first."""
        def choose(args: tuple) -> tuple[Region, ...]:
            key = tuple(tensor_type(leaf) for leaf in tree_leaves(args))
            if key not in self.plans:
                self.plans[key] = applied if _planned_for(applied, key) else self._plan(model, args, applied, key)
            return self.plans[key].regions

        return choose

    def _plan(self, model: nn.Module, args: tuple, applied: Plan, key: tuple[str, ...]) -> Plan:
        budget = applied.budget_bytes if self.budget is None else self.budget
        try:
            made = make_plan(model, args, budget, loss_fn=self.loss_fn, cache=self.cache, solver=self.solver,
                             time_limit=self.time_limit, parallel=applied.parallel)
        except ValueError as error:  # InfeasibleBudget, or a budget below what every step holds
            warnings.warn(f"optremat: inputs {', '.join(key)}: {error}; running the plan applied", stacklevel=4)
            return applied
        log.info("optremat: inputs %s planned: %s", ", ".join(key), made.summary().splitlines()[0])
        return made


def apply(model: nn.Module, plan: Plan, *, replan: Replanning | None = None) -> nn.Module:
    """`model` with `plan` installed on it, returned: same call signature, parameters
    and gradients. Its checkpointed module calls run under checkpoint; everything else
    is untouched; `remove(model)` takes the plan off again. The plan's decisions hold at
    any input shape; with `replan`, each new shape gets a plan of its own instead."""
    if not isinstance(plan, Plan):
        raise TypeError(f"apply needs an optremat Plan, not {type(plan).__name__}")
    if plan.runtime != "native":
        raise ValueError(f"this plan is for the {plan.runtime!r} runtime, not a model's own modules: op-by-op plans "
                         "run inside torch.compile; compile the model with optremat.compile_backend instead")
    return native.install(model, plan.regions, training=plan.training, fingerprint=plan.model_fingerprint,
                          mutated_buffers=plan.mutated_buffers,
                          choose=None if replan is None else replan.chooser(model, plan))


def remove(model: nn.Module) -> nn.Module:
    """Take an installed plan off `model`; returns `model`, as it was before `apply`."""
    return native.remove(model)


def _planned_for(plan: Plan, key: tuple[str, ...]) -> bool:
    """Whether `plan` was priced on inputs of these tensor types (the traced step's input
    placeholders follow its parameters and buffers)."""
    params = sum(kind == "param" for kind in plan.graph.kind)
    return tuple(plan.graph.tensor[params:params + len(key)]) == key
