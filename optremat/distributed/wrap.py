"""Wrap a model in FSDP2 or DDP as a plan for it was priced."""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from optremat.sharding import FSDP, Parallel, matcher


def wrap(model: nn.Module, parallel: Parallel, **kwargs: Any) -> nn.Module:
    """FSDP: `fully_shard` on every module matching `parallel.units` (inner modules first)
    and then on `model`, which is returned; DDP: `model` in DistributedDataParallel. Apply
    the plan first (`optremat.apply`), as torchtitan orders activation checkpointing before
    `fully_shard`; `kwargs` go to `fully_shard` or DDP."""
    if isinstance(parallel, FSDP):
        is_unit = matcher(parallel.units)
        units = [module for path, module in model.named_modules() if path and is_unit(path)]
        if parallel.units and not units:
            raise ValueError(f"no module of {type(model).__name__} matches the FSDP units {parallel.units}")
        for module in reversed(units):
            fully_shard(module, reshard_after_forward=parallel.reshard_after_forward, **kwargs)
        fully_shard(model, **kwargs)
        return model
    if kwargs.get("gradient_as_bucket_view"):
        raise ValueError("the plan prices DDP's buckets as a copy of the gradients: leave gradient_as_bucket_view off")
    return DistributedDataParallel(model, **kwargs)
