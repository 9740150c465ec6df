"""Inputs as a model takes them, and the loss a model computes itself.

Training code holds a batch as a dict (`model(**batch)`, as transformers' Trainer,
accelerate and Lightning call it), as positional arguments, or both; transformers models
given `labels` return their own loss as `outputs.loss`, nanoGPT's given `targets` as
`logits, loss`. `call_of` reads an example batch
as one of those calls, and `own_loss` finds the loss a model's output carries.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves

from optremat.tracing.deferred_head import chunked_by

LEAF_TYPES = (torch.Tensor, int, float, bool, str, type(None))
"""What an example input may hold: tensors, and constants the trace keeps as they are."""


class Inputs:
    """Example inputs for a model called as `model(*args, **kwargs)`: what `plan()` takes
    when the model needs positional and keyword arguments at once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"Inputs({len(self.args)} positional, keywords {sorted(self.kwargs)})"


Call = tuple[tuple[Any, ...], dict[str, Any]]
"""A model call's positional and keyword arguments, keywords in sorted order (so that a
batch's leaves always come in one order)."""


def call_of(example: Any) -> Call:
    """`example` as the call it stands for: a dict (any mapping) is the model's keyword
    arguments, a tuple or list its positional arguments, `Inputs` both, anything else the
    one positional argument. Raises TypeError naming an argument no trace can take."""
    if isinstance(example, Inputs):
        args, kwargs = tuple(example.args), dict(example.kwargs)
    elif isinstance(example, Mapping):
        args, kwargs = (), dict(example)
    elif isinstance(example, (tuple, list)):
        args, kwargs = tuple(example), {}
    else:
        args, kwargs = (example,), {}
    if not all(isinstance(key, str) for key in kwargs):
        raise TypeError("a batch given as a dict is passed as model(**batch): its keys must be argument names")
    call = (args, dict(sorted(kwargs.items())))
    _check_leaves(call)
    return call


def _check_leaves(call: Call) -> None:
    for path, leaf in tree_flatten_with_path(call)[0]:
        if not isinstance(leaf, LEAF_TYPES):
            where = _argument(path)
            raise TypeError(f"example input {where} is a {type(leaf).__name__}: inputs are traced as tensors, numbers, "
                            "strings and None, in tuples, lists and dicts; turn it into tensors (or keep it on the "
                            "model) and pass the batch as the model is called, e.g. plan(model, batch) for "
                            "model(**batch)")


def _argument(path: tuple) -> str:
    """An input's place as a reader names it: `input_ids`, `args[0]['mask']`."""
    text = keystr(path)
    if text.startswith("[1]"):
        rest = text[3:]
        key = rest[: rest.index("]") + 1] if rest.startswith("[") else rest
        return f"{key[2:-2]}{rest[len(key):]}" if key.startswith("['") else f"kwargs{rest}"
    return f"args{text[3:]}"


def differentiated(inputs: Any) -> list[torch.Tensor]:
    """The input tensors in `inputs` that require grad: a step's backward computes their
    gradients too (an adversarial example's, a frozen model's input in style transfer)."""
    return [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]


def input_types(args: tuple, kwargs: dict[str, Any]) -> tuple[str, ...]:
    """Per leaf of a call, in the order a trace lists its inputs, the tensor's dtype and
    shape ("" for a constant), as a Graph names its inputs' types."""
    leaves = tree_leaves((args, dict(sorted(kwargs.items()))))
    return tuple(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" if isinstance(t, torch.Tensor) else ""
                 for t in leaves)


def own_loss(out: Any) -> torch.Tensor | None:
    """The loss a model's output carries, if any: `outputs.loss` (a transformers model given
    `labels`), a dict's "loss", the output itself when it is one differentiable scalar, or
    of a tuple or list the one differentiable scalar a loss function computed from another
    of its tensors (`logits, loss = model(idx, targets)`, as nanoGPT and minGPT return it),
    or the one built on a loss a deferred head's cross-entropy computed in chunks
    (`deferred_head`: the logits it read are None, or read again).
    An output of two scalars (`logits, loss, aux_loss`) carries none: which sum trains is
    the caller's to say (`loss_fn`)."""
    found = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if found is None and isinstance(out, torch.Tensor) and out.dim() == 0:
        found = out
    if found is None and isinstance(out, (tuple, list)):
        found = _computed_from_the_rest(out)
        scalars = [t for t in out if _scalar(t)]
        if found is None and len(scalars) == 1 and chunked_by(scalars[0]) is not None:
            found = scalars[0]  # a head deferred (deferred_head) took the loss over its logits in chunks
    if _scalar(found):
        return found
    return None


def _scalar(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point() and t.requires_grad


def _computed_from_the_rest(out: tuple | list) -> torch.Tensor | None:
    """The one differentiable scalar among `out`'s items computed by a loss function
    (`_LOSS_NODES`) from another item, or None: a z-loss or an entropy over the logits,
    or a router's auxiliary loss, is not the loss."""
    scalars = [t for t in out if _scalar(t)]
    if len(scalars) != 1:
        return None
    others = {t.grad_fn for t in out if isinstance(t, torch.Tensor) and t is not scalars[0] and t.grad_fn is not None}
    seen, stack = set(), [(scalars[0].grad_fn, False)]
    while stack:
        node, through_loss = stack.pop()
        if node is None or (node, through_loss) in seen:
            continue
        if through_loss and node in others:
            return scalars[0]
        seen.add((node, through_loss))
        through_loss = through_loss or type(node).__name__.startswith(_LOSS_NODES)
        stack.extend((next_node, through_loss) for next_node, _ in node.next_functions)
    return None


_LOSS_NODES = ("NllLoss", "MseLoss", "SmoothL1Loss", "HuberLoss", "BinaryCrossEntropy", "KlDiv", "SoftMarginLoss",
               "MultiMarginLoss", "MultilabelMarginLoss", "CtcLoss")
"""How the autograd nodes of PyTorch's loss functions are named (cross-entropy's is
NllLoss's; a loss written out of sums and means has none)."""


def batch_on(batch: Any, device: torch.device) -> Any:
    """A batch's tensors moved to `device`, as training loops move a dataloader's batch
    before calling the model (a dict, or a mapping such as transformers' BatchEncoding,
    value by value; anything else as it is)."""
    if isinstance(batch, Mapping) or hasattr(batch, "items"):
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return batch
