"""Wrap a model in FSDP2 or DDP as a plan for it was priced."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from optremat.core.sharding import FSDP, Parallel, check_matched, matcher


def wrap(model: nn.Module, parallel: Parallel, **kwargs: Any) -> nn.Module:
    """FSDP: `fully_shard` on every module matching `parallel.units` (inner modules first),
    on the modules of each of `parallel.groups` together (kept gathered through the
    backward), and then on `model`, which is returned; DDP: `model` in
    DistributedDataParallel. Apply the plan first (`optremat.apply`), as torchtitan orders
    activation checkpointing before `fully_shard`; `kwargs` go to `fully_shard` or DDP."""
    if isinstance(parallel, FSDP):
        units = _matching(model, parallel.units)
        for module in reversed(units):
            fully_shard(module, reshard_after_forward=parallel.reshard_after_forward, **kwargs)
        for group in parallel.groups:
            fully_shard(_matching(model, group), **{**kwargs, "reshard_after_forward": False})
        fully_shard(model, **kwargs)
        return model
    if kwargs.get("gradient_as_bucket_view"):
        raise ValueError("the plan prices DDP's buckets as a copy of the gradients: leave gradient_as_bucket_view off")
    return DistributedDataParallel(model, **kwargs)


def _matching(model: nn.Module, patterns: tuple[str, ...]) -> list[nn.Module]:
    """The modules of `model` whose paths match `patterns` (none for none)."""
    check_matched(type(model).__name__, (path for path, _ in model.named_modules() if path), patterns)
    is_unit = matcher(patterns)
    return [module for path, module in model.named_modules() if path and is_unit(path)]


def held_by_rank(model: nn.Module, wrapped: nn.Module, *more: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """What a rank keeps between steps, as tensors to measure a step's peak on top of: its
    shards of `model`'s parameters and buffers (the tensors themselves without FSDP),
    tensors as large as DDP's gradient buckets, and the tensors in `more` (optimizer
    state), each by its local shard. DDP's buckets come from its own list: it allocates
    them when it wraps the model, where gloo frees its broadcast of the parameters on a
    thread the profiler does not see, so they cannot be measured as allocations."""
    tensors = [*model.parameters(), *model.buffers(), *(t for group in more for t in group)]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if isinstance(t, torch.Tensor)]
    reducer = getattr(wrapped, "reducer", None)
    buckets = [] if reducer is None else [bucket.buffer() for bucket in reducer._get_zeros_like_grad_buckets()]
    return local + buckets
