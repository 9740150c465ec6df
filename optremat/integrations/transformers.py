"""optremat as the memory-budget switch of transformers' Trainer.

`Trainer(..., callbacks=[optremat.integrations.transformers.PlanCallback(budget=0.7)])`
plans the model on the first training batch, as the Trainer will call it (`model(**batch)`,
the model's own loss from `labels`), and applies the plan before the first step; a batch
of another shape later is planned on its first step (`optremat.Replanning`). With `cache`,
a second run loads its plans instead of solving.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from optremat.planning.model import own_checkpointing
from optremat.planning.model import plan as make_plan
from optremat.planning.result import Plan
from optremat.runtime.apply import Replanning, apply
from optremat.tracing.extract import host_random_kept
from optremat.tracing.inputs import batch_on
from optremat.tracing.lm_loss import AUTO

log = logging.getLogger("optremat")


class PlanCallback(TrainerCallback):
    """Plans and applies activation checkpointing at `budget` (bytes, a size such as
    "6GiB", or a fraction of the unplanned peak) when training begins. Reading the first
    batch and planning leave the random number generators as they were (torch's, numpy's
    and Python's), so training draws the numbers it would draw without the callback; a
    dataset read once as a stream is refused, its first batch would be lost to training.
    `plan` is the plan applied, once made; `replanning` is the `optremat.Replanning` it
    runs under: `replanning.plans` holds the plan of each input shape training has
    stepped on (the first batch's `plan` among them), and `replanning.planning_seconds`
    the time spent planning after the first.
    `time_limit`, `deterministic` and `head_chunks` are `optremat.plan`'s: with
    `deterministic=True` the limit is the solver's deterministic time, so the plans do not
    depend on machine load; a causal LM whose head the plan runs in chunks returns
    `outputs.logits` as None from its training steps, and `head_chunks=None` keeps them."""

    def __init__(self, budget: int | float | str, *, cache: str | Path | None = None, solver: str = "auto",
                 time_limit: float = 30.0, deterministic: bool = False, head_chunks: int | str | None = AUTO) -> None:
        self.budget = budget
        self.cache = cache
        self.solver = solver
        self.time_limit = time_limit
        self.deterministic = deterministic
        self.head_chunks = head_chunks
        self.plan: Plan | None = None
        self.replanning: Replanning | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                       train_dataloader: Any = None, **kwargs: Any) -> None:
        if model is None or train_dataloader is None:
            raise ValueError("optremat's PlanCallback needs the Trainer's model and training dataloader")
        if own_checkpointing(model):
            raise ValueError("the model has transformers' own activation checkpointing on, and optremat plans "
                             "checkpointing itself: leave TrainingArguments' activation_checkpointing (or "
                             "gradient_checkpointing) off with this callback")
        device = next(model.parameters()).device
        training = model.training
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), host_random_kept():
            _restartable(train_dataloader)
            batch = batch_on(next(iter(train_dataloader)), device)
            model.train()
            try:
                self.plan = make_plan(model, batch, self.budget, cache=self.cache, solver=self.solver,
                                      time_limit=self.time_limit, deterministic=self.deterministic,
                                      head_chunks=self.head_chunks)
            finally:
                model.train(training)
        log.info("optremat: %s", self.plan.summary().replace("\n", "; "))
        self.replanning = Replanning(self.budget, cache=self.cache, solver=self.solver, time_limit=self.time_limit,
                                     deterministic=self.deterministic)
        apply(model, self.plan, replan=self.replanning)


def _restartable(loader: Any) -> None:
    """Refuse a loader whose dataset is a stream read once (an IterableDataset whose
    `__iter__` returns the same iterator): the batch read to plan on would be lost to
    training."""
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, torch.utils.data.IterableDataset) and iter(dataset) is iter(dataset):
        raise ValueError(f"{type(dataset).__name__} is a stream read once (its __iter__ returns the same iterator), "
                         "so the batch PlanCallback reads to plan on would not be trained on: plan the model with "
                         "optremat.plan on an example batch and optremat.apply it before training instead")
