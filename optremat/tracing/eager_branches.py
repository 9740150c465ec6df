"""Branches a model takes on its tensors' values, taken in a trace as eager takes them.

transformers builds no attention mask for a batch with no padded token and no packed
sequences: its attention runs with `is_causal` (or no mask) instead. To know that, it reads
the values of the position ids and the padding mask, which no tracer can, so under any
tracer, fake tensors included, it builds the mask: a trace of a decoder would price a
mask, and a float copy of it that every attention call holds for the backward, that the
eager step never allocates (over 10% of the peak of a small Mixtral at 256 tokens). While
optremat traces a step, transformers' own decisions run on the real values of the
tensors they read, computed from the example inputs by the traced ops that produced them,
so the trace takes the branch the training step takes on the example batch.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

DECISIONS = ("find_packed_sequence_indices", "_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")
"""The functions of `transformers.masking_utils` that read a tensor's values (their first
argument's) to decide whether a mask is needed: None or a tensor, or a bool."""


@contextmanager
def eager_mask_decisions(leaves: list[Any]) -> Iterator[None]:
    """While a step is traced on `leaves` (the real values of its placeholders, in order),
    transformers' mask decisions answer as on those values. A decision on a tensor that
    `real_value` cannot compute from them is left as transformers makes it under a
    tracer. Nothing changes without transformers loaded, or outside the trace."""
    masking = sys.modules.get("transformers.masking_utils")
    originals = {name: getattr(masking, name) for name in DECISIONS if hasattr(masking, name)}
    for name, original in originals.items():
        setattr(masking, name, _as_eager(original, leaves))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(masking, name, original)


class EagerScalarReads(TorchDispatchMode):
    """While a step is traced on `leaves` (the real values of its placeholders, in order),
    a tensor read as a Python number (`.item()`, `bool(tensor)`, `if tensor:`) reads the
    value eager computes on those inputs (`real_value`) where it can: a check on the
    labels (`labels.max() >= vocab_size`) passes as it does in the step, and a branch on a
    value takes the example batch's way. Where the value cannot be computed (it depends on
    a random op, or the model is on the meta device) the read is left to the tracer,
    which refuses it. `read()` is called at each read answered. Enter it inside the
    trace, above its modes."""

    def __init__(self, leaves: list[Any], read: Callable[[], None]) -> None:
        super().__init__()
        self.leaves, self.read = leaves, read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.ops.aten._local_scalar_dense.default:
            real = real_value(args[0], self.leaves)
            if real is not None:
                self.read()
                return real.item()
        return func(*args, **(kwargs or {}))


def _as_eager(decide: Callable[..., Any], leaves: list[Any]) -> Callable[..., Any]:
    """`decide` traced (its ops are the step's), then run on the real value of its first
    argument outside the trace: its answer there where that is a decision (None, a bool),
    the traced call's where it is a tensor (the packed-sequence ids a mask is built from)."""

    def decided(first: Any, *args: Any, **kwargs: Any) -> Any:
        traced = decide(first, *args, **kwargs)
        real = real_value(first, leaves) if isinstance(first, torch.Tensor) else None
        if real is None:
            return traced
        with _disable_current_modes(), torch.no_grad():
            answer = decide(real, *args, **kwargs)
        return traced if isinstance(answer, torch.Tensor) else answer

    return decided


def real_value(tensor: torch.Tensor, leaves: list[Any]) -> torch.Tensor | None:
    """The value eager computes for `tensor`, a tensor of the trace under way: the traced
    ops it depends on, rerun on `leaves`. None where it is no traced tensor, where it
    depends on a value the trace holds only as a fake tensor or an input on the meta
    device (a model too large to build, planned for its shapes), or where rerunning its ops
    could differ from the step or change its inputs (a random op, an op writing in place)."""
    mode = get_proxy_mode()
    slot = None if mode is None else get_proxy_slot(tensor, mode.tracer, None)
    if slot is None:
        return None
    target: torch.fx.Node = slot.proxy.node
    needed = _ancestors(target)
    if any(_random(node) or writes_in_place(node) for node in needed):
        return None
    placeholders = [node for node in target.graph.nodes if node.op == "placeholder"]
    values = dict(zip(placeholders, leaves, strict=True))
    values.update((node, getattr(mode.tracer.root, node.target)) for node in needed if node.op == "get_attr")
    given = [v for n, v in values.items() if n in needed and isinstance(v, torch.Tensor)]
    if any(type(v) not in (torch.Tensor, torch.nn.Parameter) or v.is_meta for v in given):
        return None
    with _disable_current_modes(), torch.no_grad():
        for node in target.graph.nodes:
            if node in needed and node not in values:
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
                values[node] = node.target(*args, **_off_meta(kwargs))
    value = values[target]
    return value if type(value) is torch.Tensor else None


def _off_meta(kwargs: dict[str, Any]) -> dict[str, Any]:
    """An op's keyword arguments with a meta device made the CPU: a value no input feeds
    (positions from `arange`, say) is computed for real even for a model on the meta device."""
    device = kwargs.get("device")
    return {**kwargs, "device": "cpu"} if device is not None and torch.device(device).type == "meta" else kwargs


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    found, stack = {node}, [node]
    while stack:
        for source in stack.pop().all_input_nodes:
            if source not in found:
                found.add(source)
                stack.append(source)
    return found


def _random(node: torch.fx.Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def writes_in_place(node: torch.fx.Node) -> bool:
    """Whether `node` writes into a tensor it is given (an in-place op or one with `out=`)."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
