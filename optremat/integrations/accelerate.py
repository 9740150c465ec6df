"""optremat where accelerate shards a model: its FSDP2 plugin.

accelerate turns checkpointing on with `FullyShardedDataParallelPlugin(activation_checkpointing=True)`,
which checkpoints every layer it shards. With optremat, the Accelerator stays as it is
(the FSDP2 plugin, with that switch off) and its `prepare` call is planned:

    prepare = optremat.integrations.accelerate.Prepare(budget=0.7)
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader)

`Prepare` reads the FSDP2 units accelerate will make of the model (the layers its wrap
policy picks, the input embedding, the final norm and LM head sharded together, the
root), plans one step per rank for them on every rank (`optremat.distributed.plan`: the
ranks agree, rank 0 solves), applies the plan, and then lets `accelerator.prepare` shard
the model, as torchtitan orders checkpointing before `fully_shard`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import DynamoBackend, get_module_children_bottom_up
from accelerate.utils.fsdp_utils import _find_final_norm, fsdp2_prepare_auto_wrap_policy
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from optremat.core.sharding import FSDP, matcher
from optremat.distributed.agree import plan as plan_every_rank
from optremat.planning.result import Plan
from optremat.runtime.apply import apply
from optremat.runtime.native import PlanMismatch
from optremat.tracing.costs import profile_for
from optremat.tracing.inputs import batch_on

log = logging.getLogger("optremat")


class Prepare:
    """`accelerator.prepare(*args)`, the model among `args` planned first at `budget` per
    rank (bytes, a size such as "6GiB", or a fraction of one rank's unplanned peak), its
    optimizer's state priced at `optimizer_state` bytes per parameter byte (2 for AdamW).
    The step planned is `model(**batch)` with the model's own loss (`outputs.loss`), on
    `batch=` or else the first batch of the DataLoader among `args` (read with the random
    number generators left as they were), in training mode. `plan` is the plan applied,
    once made; `cache`, `solver`, `time_limit` and `deterministic` are `optremat.plan`'s.
    A causal LM's own head and loss run whole or in token chunks as the plan chooses: the
    head in chunks never runs its forward, and FSDP2 completes the group of the final
    norm and the head that accelerate makes without it (torch 2.13).

    The Accelerator must run FSDP2 with what the plan prices: no activation checkpointing
    of its own, no mixed-precision policy, no CPU offload, no ignored modules, no
    torch.compile and no parallelism but sharding; anything else is refused before the
    model is planned. After `accelerator.prepare`, the modules it sharded are checked
    against those planned (PlanMismatch if accelerate sharded others)."""

    def __init__(self, budget: int | float | str, *, optimizer_state: float = 0.0, cache: str | Path | None = None,
                 solver: str = "auto", time_limit: float = 30.0, deterministic: bool = False) -> None:
        self.budget = budget
        self.optimizer_state = optimizer_state
        self.cache = cache
        self.solver = solver
        self.time_limit = time_limit
        self.deterministic = deterministic
        self.plan: Plan | None = None

    def __call__(self, accelerator: Accelerator, *args: Any, batch: Any = None) -> Any:
        _check(accelerator)
        models = [arg for arg in args if isinstance(arg, nn.Module)]
        if len(models) != 1:
            raise ValueError(f"optremat plans one model per accelerator.prepare call, and {len(models)} were passed")
        model = models[0]
        parallel = units(accelerator, model, self.optimizer_state)
        device = next(model.parameters()).device
        training = model.training
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            example = batch_on(_first_batch(accelerator, args) if batch is None else batch, device)
            model.train()
            try:
                self.plan = plan_every_rank(model, example, self.budget, parallel, cache=self.cache,
                                            solver=self.solver, time_limit=self.time_limit,
                                            deterministic=self.deterministic, device=profile_for(accelerator.device))
            finally:
                model.train(training)
        log.info("optremat: %s", self.plan.summary().replace("\n", "; "))
        apply(model, self.plan)
        prepared = accelerator.prepare(*args)
        _check_sharded(model, parallel)
        return prepared


def units(accelerator: Accelerator, model: nn.Module, optimizer_state: float = 0.0) -> FSDP:
    """The FSDP2 job `accelerator.prepare` makes of `model`, as optremat prices it: a unit
    for each module its auto-wrap policy picks and for an input embedding not tied to the
    output embedding, one group of the final norm and the LM head (and a tied input
    embedding), kept gathered from their forward through their backward, and the model
    as the root."""
    plugin = accelerator.state.fsdp_plugin
    plugin.set_auto_wrap_policy(model)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    path = {module: name for name, module in model.named_modules()}
    picked = [module for module in get_module_children_bottom_up(model)[:-1] if policy is not None and policy(module)]
    embedding = getattr(model, "get_input_embeddings", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    weight = getattr(embedding, "weight", None)
    tied = weight is not None and weight is getattr(head, "weight", None)
    if embedding is not None and not tied and embedding not in picked:
        picked.append(embedding)
    norm = _find_final_norm(model)
    tail = [module for module in ((norm, embedding, head) if tied else (norm, head))
            if module is not None and module not in picked]
    return FSDP(units=tuple(path[module] for module in picked), world=accelerator.num_processes,
                reshard_after_forward=plugin.reshard_after_forward, optimizer_state=optimizer_state,
                groups=(tuple(path[module] for module in tail),) if tail else ())


def _check(accelerator: Accelerator) -> None:
    """Refuse an Accelerator whose FSDP2 job differs from what a plan prices."""
    if not accelerator.is_fsdp2:
        raise ValueError("optremat's Prepare plans FSDP2 as accelerate applies it: create the Accelerator with "
                         "fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2) (accelerate turns FSDP on for "
                         "GPUs and other accelerators, not on CPUs); without FSDP2, plan with optremat.plan and apply")
    plugin = accelerator.state.fsdp_plugin
    pc = accelerator.parallelism_config
    refused = {
        "activation_checkpointing=True": plugin.activation_checkpointing,
        f"mixed_precision={accelerator.mixed_precision!r}": (accelerator.mixed_precision != "no"
                                                             or plugin.mixed_precision_policy is not None),
        "cpu_offload": isinstance(plugin.cpu_offload, CPUOffloadPolicy),
        "ignored_modules": plugin.ignored_modules is not None,
        "a dynamo backend": accelerator.state.dynamo_plugin.backend != DynamoBackend.NO,
        "tensor, context or replicated data parallelism": pc is not None and (
            pc.tp_enabled or pc.cp_enabled or pc.dp_replicate_enabled),
    }
    given = [name for name, on in refused.items() if on]
    if given:
        raise ValueError(f"optremat plans FSDP2 steps without {', '.join(given)}, and this Accelerator has "
                         f"{'them' if len(given) > 1 else 'it'}: turn {'them' if len(given) > 1 else 'it'} off "
                         "(optremat plans checkpointing itself; a model in bfloat16 is planned as it is)")


def _first_batch(accelerator: Accelerator, args: tuple[Any, ...]) -> Any:
    """The first batch of the DataLoader among `args`: one rank's, as accelerate does not
    split batches unless told to."""
    loaders = [arg for arg in args if isinstance(arg, torch.utils.data.DataLoader)]
    if not loaders:
        raise ValueError("optremat plans the model on an example batch: pass batch=..., or the training "
                         "DataLoader to the same prepare call")
    if accelerator.split_batches:
        raise ValueError("with split_batches, one rank's batch is a slice of the DataLoader's: pass batch=... "
                         "shaped as one rank's")
    return next(iter(loaders[0]))


def _check_sharded(model: nn.Module, parallel: FSDP) -> None:
    """Raise PlanMismatch unless the modules accelerate sharded are those the plan priced."""
    planned = matcher(parallel.units + tuple(path for group in parallel.groups for path in group))
    sharded = {path for path, module in model.named_modules() if path and isinstance(module, FSDPModule)}
    expected = {path for path, _ in model.named_modules() if path and planned(path)}
    if sharded != expected:
        raise PlanMismatch(f"accelerate sharded other modules than the plan priced (sharded and not planned: "
                           f"{sorted(sharded - expected)[:3]}, planned and not sharded: "
                           f"{sorted(expected - sharded)[:3]}): this accelerate shards models in a way optremat "
                           "does not know; plan with optremat.distributed.plan and wrap with optremat.distributed.wrap")
