"""`apply(model, plan)` and `remove(model)`: a model trained under a plan, and back."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from optremat.core.budget import check_budget
from optremat.distributed.agree import PlanningFailed
from optremat.distributed.agree import plan as plan_every_rank
from optremat.ilp.search import check_time_limit
from optremat.planners.regions import Region
from optremat.planners.solve import SOLVERS
from optremat.planning.model import plan as make_plan
from optremat.planning.result import Plan
from optremat.runtime import native
from optremat.runtime.caller import warn
from optremat.tracing import causal_lm, lm_loss
from optremat.tracing.extract import ExtractionError
from optremat.tracing.inputs import Inputs, input_types
from optremat.tracing.lm_loss import AUTO, CausalLMLoss

log = logging.getLogger("optremat")


@dataclass(eq=False)
class Replanning:
    """Plan again on the first training step at each new input shape (batch size,
    sequence length), at `budget`: bytes or a size hold for every shape, a fraction is of
    each shape's unplanned peak; None keeps the applied plan's budget in bytes. The other
    fields are `plan()`'s, and ops are priced as the applied plan priced them (its
    `cost_model` and `device`); with `cache`, a shape planned once loads in later runs. A shape
    no plan fits runs the plan applied, with a warning naming the smallest budget. A plan
    for a data-parallel job, inside a process group, is made for every rank as
    `optremat.distributed.plan` makes it (ranks agree, rank 0 plans): every rank must then
    meet each new input shape at the same step. The LM head keeps the applied plan's
    chunks (`Plan.chunking`), a `CausalLMLoss`'s or the model's own head and loss: each
    shape's regions are planned for them.
    `plans` holds the plan of each shape seen, by its inputs' tensor types (0-d tensors
    and constants left out: a token count passed for the loss, as transformers' Trainer
    passes `num_items_in_batch`, sizes no activation), so `len(plans)` counts the shapes
    planned; `planning_seconds` is the wall time spent planning them, tracing included."""

    budget: int | float | str | None = None
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    cache: str | Path | None = None
    solver: str = "auto"
    time_limit: float = 30.0
    deterministic: bool = False
    plans: dict[tuple[str, ...], Plan] = field(default_factory=dict)
    planning_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.budget is not None:
            check_budget(self.budget)
        if self.solver not in SOLVERS:
            raise ValueError(f"unknown solver {self.solver!r}; choose one of {', '.join(SOLVERS)}")
        check_time_limit(self.time_limit)

    def chooser(self, model: nn.Module, applied: Plan, head_chunks: int | None = None) -> native.Choose:
        """What picks the regions of `model`'s forward for its inputs, `applied` first;
        `head_chunks` are those the model's own LM head and loss run in as applied."""
        return functools.partial(self._choose, model, applied, head_chunks)

    def _choose(self, model: nn.Module, applied: Plan, head_chunks: int | None, args: tuple,
                kwargs: dict[str, Any]) -> tuple[Region, ...]:
        key = _shaped(input_types(args, kwargs))
        if _in_a_group(applied) and not _every_rank_has(key):
            return applied.regions
        if key not in self.plans:
            self.plans[key] = (applied if _planned_for(applied, key)
                               else self._plan(model, Inputs(*args, **kwargs), applied, head_chunks, key))
        return self.plans[key].regions

    def _plan(self, model: nn.Module, args: Inputs, applied: Plan, head_chunks: int | None,
              key: tuple[str, ...]) -> Plan:
        budget = applied.budget_bytes if self.budget is None else self.budget
        loss_fn = _labelled_like(self.loss_fn, args) if isinstance(self.loss_fn, CausalLMLoss) else self.loss_fn
        if applied.chunking is not None and isinstance(loss_fn, CausalLMLoss) and loss_fn.chunks == AUTO:
            loss_fn = loss_fn.with_chunks(applied.chunking.chunks)  # the head runs as the applied plan says
        options = dict(loss_fn=loss_fn, head_chunks=AUTO if loss_fn is not None else head_chunks, cache=self.cache,
                       solver=self.solver, time_limit=self.time_limit, deterministic=self.deterministic,
                       cost_model=applied.cost_model, device=applied.device)
        started = time.perf_counter()
        try:
            if _in_a_group(applied):
                made = plan_every_rank(model, args, budget, applied.parallel, **options)
            else:
                made = make_plan(model, args, budget, parallel=applied.parallel, **options)
        except (ValueError, PlanningFailed, ExtractionError) as error:
            # InfeasibleBudget, a budget below what every step holds, a loss that cannot take this shape's output
            if isinstance(error, PlanningFailed) and not error.refused:
                raise
            warn(f"optremat: inputs {_shown(key)}: {error}; running the plan applied")
            return applied
        finally:
            self.planning_seconds += time.perf_counter() - started
        log.info("optremat: inputs %s planned: %s", _shown(key), made.summary().splitlines()[0])
        return made


def apply(model: nn.Module, plan: Plan, *, replan: Replanning | None = None) -> nn.Module:
    """`model` with `plan` installed on it, returned: same call signature, parameters
    and gradients. Its checkpointed module calls run under checkpoint; everything else
    is untouched; where the plan chose how to run a causal LM's head (`Plan.chunking`),
    every `CausalLMLoss(chunks="auto")` over that head runs so, and a transformers causal
    LM planned with its own loss runs its head and loss in the plan's chunks on each
    training step given `labels` (`outputs.logits` is then None). `remove(model)` takes the
    plan off again. The plan's decisions hold at any input shape; with `replan`, each new
    shape gets region plans of its own instead (the head keeps the applied plan's chunks)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"apply needs an optremat Plan, not {type(plan).__name__}")
    if plan.runtime != "native":
        raise ValueError(f"this plan is for the {plan.runtime!r} runtime, not a model's own modules: op-by-op plans "
                         "run inside torch.compile; compile the model with optremat.compile_backend instead")
    head = _head(model, plan)
    try:
        own = (None if plan.chunking is None
               else causal_lm.own_chunks(model, plan.chunking.chunks, plan.chunking.head))
    except ValueError as error:
        raise native.PlanMismatch(f"the plan runs the model's own LM head and loss in chunks, and {error}: plan "
                                  "again") from None
    installed = native.install(model, plan.regions, training=plan.training, fingerprint=plan.model_fingerprint,
                               mutated_buffers=plan.mutated_buffers,
                               choose=None if replan is None else replan.chooser(model, plan, own),
                               forward=None if own is None else causal_lm.chunked_forward(model, plan.chunking.head, own))
    lm_loss.uninstall(list(model.parameters()))
    if head is not None:
        lm_loss.install(head, plan.chunking.chunks)
    return installed


def remove(model: nn.Module) -> nn.Module:
    """Take an installed plan off `model`; returns `model`, as it was before `apply`."""
    lm_loss.uninstall(list(model.parameters()))
    return native.remove(model)


def _head(model: nn.Module, plan: Plan) -> torch.Tensor | None:
    """The LM head weight whose losses run in the plan's chunks (`Plan.chunking`), if
    the plan chose any: a "auto" `CausalLMLoss` over it then runs as planned."""
    if plan.chunking is None:
        return None
    head = dict(model.named_parameters()).get(plan.chunking.head)
    if head is None:
        raise native.PlanMismatch(f"the plan runs the LM head {plan.chunking.head!r} in chunks, but "
                                  f"{type(model).__name__} has no such parameter: apply a plan made for this model")
    return head


def _labelled_like(loss_fn: CausalLMLoss, args: Inputs) -> CausalLMLoss:
    """`loss_fn` with labels shaped as this call's token ids (its first integer tensor with
    as many dimensions as the labels), so that a shape other than the one its labels were
    made for is planned: a plan prices the labels' shape, not their values."""
    labels = loss_fn.labels
    ids = next((t for t in tree_leaves((args.args, args.kwargs)) if isinstance(t, torch.Tensor)
                and not t.is_floating_point() and t.dim() == labels.dim()), None)
    if ids is None or ids.shape == labels.shape:
        return loss_fn
    return replace(loss_fn, labels=torch.zeros(ids.shape, dtype=labels.dtype, device=labels.device))


def _in_a_group(plan: Plan) -> bool:
    """Whether `plan` is for a data-parallel job running in a process group now."""
    return plan.parallel is not None and dist.is_available() and dist.is_initialized()


def _every_rank_has(key: tuple[str, ...]) -> bool:
    """Whether every rank of the default group steps on inputs of these types; warns if not."""
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, key)
    differ = next((rank for rank, theirs in enumerate(keys) if theirs != key), None)
    if differ is not None:
        warn(f"optremat: rank {dist.get_rank()} steps on inputs {_shown(key)} and rank {differ} on "
             f"{_shown(keys[differ])}: every rank runs the plan applied at this step, so that all run "
             "the same regions")
    return differ is None


def _shown(key: tuple[str, ...]) -> str:
    """A call's tensor types as a message names them (constants left out)."""
    return ", ".join(filter(None, key))


def _shaped(types: Sequence[str]) -> tuple[str, ...]:
    """The types of a call's tensors that have a shape: constants ("") and 0-d tensors
    left out, since passing them or not changes no activation's size."""
    return tuple(t for t in types if t and not t.endswith("[]"))


def _planned_for(plan: Plan, key: tuple[str, ...]) -> bool:
    """Whether `plan` was priced on inputs of these shaped tensor types (a traced step's
    inputs come first among its input nodes, in the order of the call's leaves)."""
    inputs = [t for t, kind in zip(plan.graph.tensor, plan.graph.kind) if kind == "input"]
    return _shaped(inputs)[:len(key)] == key
