"""Key/value caches a module call is handed.

A transformers model run with `use_cache` builds a key/value cache and hands it to each
attention call, which appends its keys and values to it. Under `torch.utils.checkpoint`
such a call would append them again when it reruns in the backward, read back a longer
cache than its forward did, and save other tensors: checkpoint raises. So a call handed a
cache made outside it is never checkpointed; one that makes its own (a decoder stack)
may be, since its rerun makes another. A cache the model returns holds its keys and
values for as long as the output lives.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


def is_cache(value: Any) -> bool:
    """Whether `value` is a transformers key/value cache."""
    cache = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    return cache is not None and isinstance(value, cache)


def receives_cache(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a call with these arguments is handed a transformers key/value cache, at
    any depth of the tuples, lists and dicts it is passed."""
    return any(is_cache(value) for value in tree_leaves((args, kwargs), is_leaf=is_cache))


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """The tensors a cache holds, through its attributes, lists and dicts at any depth."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    todo = [cache]
    while todo:
        value = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            todo.extend(value)
        elif isinstance(value, dict):
            todo.extend(value.values())
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            todo.extend(vars(value).values())
    return found
