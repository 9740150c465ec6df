"""One plan for every rank of a process group."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch.distributed as dist
import torch.nn as nn

from optremat.core.sharding import Parallel
from optremat.planning.model import plan as plan_one_rank
from optremat.planning.result import Plan
from optremat.runtime.native import PlanMismatch
from optremat.tracing.fingerprint import model_fingerprint
from optremat.tracing.inputs import call_of, input_types

_COMPARED = ("solver", "time_limit", "cost_model", "device", "workers", "seed", "deterministic", "runtime",
             "head_chunks")
"""Planning options every rank must pass alike (callables such as loss_fn cannot be compared)."""


class PlanningFailed(RuntimeError):
    """Rank 0 could not plan; the other ranks raise this, with rank 0's reason. `refused`
    says rank 0 raised a ValueError (a budget no plan fits, ranks that disagree), where
    rank 0 refused the request rather than failed."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


def plan(model: nn.Module, example_inputs: Sequence[Any] | Any, budget: int | float | str, parallel: Parallel, *,
         group: dist.ProcessGroup | None = None, **options: Any) -> Plan:
    """`optremat.plan` for every rank of `group` (the default group when None): each rank
    passes its own model and inputs of one rank's shape, rank 0 plans, and every rank gets
    the same plan. `parallel.world` may be 0 (it becomes the group's size). Raises
    PlanMismatch on every rank when a rank's model, input shapes, budget or options differ
    from rank 0's, and PlanningFailed on the other ranks when rank 0's planning raises."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("optremat.distributed.plan runs inside a process group: call "
                           "torch.distributed.init_process_group first, or plan one rank with "
                           "optremat.plan(..., parallel=FSDP(world=N))")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if parallel.world not in (0, world):
        raise ValueError(f"{type(parallel).__name__}(world={parallel.world}) but the process group has {world} ranks")
    parallel = replace(parallel, world=world)
    _agree(model, example_inputs, budget, parallel, options, group, world)
    made, failure = None, None
    if rank == 0:
        try:
            made = plan_one_rank(model, example_inputs, budget, parallel=parallel, **options)
            message = [made.to_json()]
        except Exception as error:  # noqa: BLE001 - sent to every rank before it is raised here
            failure = error
            message = [{"error": f"{type(error).__name__}: {error}", "refused": isinstance(error, ValueError)}]
    else:
        message = [None]
    dist.broadcast_object_list(message, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if failure is not None:
        raise failure
    if "error" in message[0]:
        raise PlanningFailed(f"planning on rank 0 failed: {message[0]['error']}", message[0]["refused"])
    return made if made is not None else Plan.from_json(message[0])


def _agree(model: nn.Module, example_inputs: Any, budget: Any, parallel: Parallel, options: dict[str, Any],
           group: dist.ProcessGroup | None, world: int) -> None:
    """Raise PlanMismatch on every rank unless every rank plans the same thing."""
    mine = {"model": model_fingerprint(model),
            "input shapes": repr(input_types(*call_of(example_inputs))),
            "budget": repr(budget), "parallel": parallel.describe(),
            "options": repr({k: options[k] for k in _COMPARED if k in options})}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine, group=group)
    for rank, theirs in enumerate(every):
        differ = [k for k in mine if theirs[k] != every[0][k]]
        if differ:
            raise PlanMismatch(f"rank {rank} differs from rank 0 in its {', '.join(differ)} "
                               f"({theirs[differ[0]]} vs {every[0][differ[0]]}): every rank must plan the same "
                               "model at the same input shapes, budget and options")
