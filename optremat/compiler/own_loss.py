"""A compiled graph's own LM head and cross-entropy, run after it in the plan's chunks.

A model that takes its loss in its forward (nanoGPT's `logits = self.lm_head(x)`, then
`F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))`) hands
torch.compile one graph computing the whole logits. `split_own_loss` finds that head and
loss at the end of the graph dynamo hands the backend: an `F.linear` at least
`WIDENING` times wider than its input, its logits read only by a flattening (after a
cast to float32 where they are not in it, as transformers' loss casts them) and that
cross-entropy (and returned), the loss only returned: nanoGPT's, and a transformers
Llama's own loss compiled whole, without `num_items_in_batch`. Its `prefix` is the graph
without them, returning the head's input and the targets besides; its `loss` is the
`CausalLMLoss` over the head's weight that computes the same loss from them, for the
backend to plan the prefix with (its chunks chosen with the plan,
`Partitioner._chunked`); `run` runs the compiled prefix, then that loss in the chunks
chosen, and returns what the graph returns, the logits None (the loss alone read
them, as `CausalLMLoss` and the native runtime's deferred head return them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.multiprocessing.reductions import StorageWeakRef

from optremat.tracing.deferred_head import WIDENING
from optremat.tracing.lm_loss import CausalLMLoss, cross_entropy_arguments, loss_options

_FLATTENING = ("view", "reshape", "flatten")
LOGITS, LOSS, HIDDEN = "logits", "loss", "hidden"
"""Places in a graph's outputs of the logits and the loss taken out of it, and of the
head's input."""


@dataclass(frozen=True)
class OwnLoss:
    """A graph's head and loss taken out of it (`split_own_loss`): `prefix` computes the
    rest; `weight` and `bias` index the graph's inputs holding the head's; `options` are
    the `CausalLMLoss` options computing the loss; `outputs` lays out the graph's
    outputs: LOGITS, LOSS, HIDDEN, or the index of the prefix's output after the head's
    input and the targets."""

    prefix: fx.GraphModule
    weight: int
    bias: int | None
    options: dict[str, Any]
    outputs: tuple[int | str, ...]

    def loss(self, example_inputs: Sequence[Any], labels: torch.Tensor, chunks: Any) -> CausalLMLoss:
        """The loss over the head's weight and bias in `example_inputs` (a call's
        arguments), against `labels`, in `chunks`."""
        bias = None if self.bias is None else example_inputs[self.bias]
        return CausalLMLoss(example_inputs[self.weight], labels, bias=bias, **self.options, chunks=chunks)

    def priced(self, example_inputs: Sequence[Any], hidden: torch.Tensor) -> CausalLMLoss:
        """The loss the backend prices the prefix with, its chunks left to the plan: over
        labels for the head's input `hidden`, none ignored."""
        with unset_fake_temporarily():
            labels = torch.zeros(hidden.shape[:-1], dtype=torch.long, device=hidden.device)
        return self.loss(example_inputs, labels, "auto")

    def run(self, prefix: Callable[..., Any], chunks: int | None) -> Callable[..., Any]:
        """What runs the compiled `prefix`, then the loss in `chunks` token chunks (None:
        whole), and returns the graph's outputs with the logits None."""

        def step(*args: Any) -> list[Any]:
            hidden, target, *rest = prefix(*args)
            with torch.autocast(hidden.device.type, enabled=False):  # the graph's head ran in its weight's dtype
                loss = self.loss(args, target.reshape(hidden.shape[:-1]), chunks)(hidden)
            named = {LOGITS: None, LOSS: loss, HIDDEN: hidden}
            return [named[at] if isinstance(at, str) else rest[at] for at in self.outputs]

        return step


def split_own_loss(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[OwnLoss, torch.Tensor] | None:
    """The head and loss at the end of `gm` taken out of it, and the head input's example
    value; None where the graph has none (or its loss takes no gradient), or where the head's
    input shares its storage with another output (a view of it is not handed to the loss
    the prefix is priced with, so it would not be priced)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    results = output.args[0]
    if not isinstance(results, (tuple, list)):
        return None
    found = [_head_and_loss(n, output) for n in results if isinstance(n, fx.Node)]
    found = [f for f in found if f is not None]
    if len(found) != 1:
        return None
    loss, taken, (hidden, weight, bias), target, options = found[0]
    logits = taken[-1]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if weight not in placeholders or (bias is not None and bias not in placeholders):
        return None
    value = hidden.meta["example_value"]
    dense = value.is_contiguous()
    kept = [r for r in results if r is not loss and r is not logits and not (dense and r is hidden)]
    storage = StorageWeakRef(value.untyped_storage())
    if (options is None or not isinstance(example_inputs[placeholders.index(weight)], torch.Tensor)
            or any(isinstance(r, fx.Node) and isinstance(r.meta.get("example_value"), torch.Tensor)
                   and StorageWeakRef(r.meta["example_value"].untyped_storage()) == storage for r in kept)):
        return None
    graph = fx.Graph()
    copied: dict[fx.Node, fx.Node] = {}
    graph.graph_copy(gm.graph, copied)
    handed, handed_value = copied[hidden], value
    if not dense:  # copied inside the graph, where the plan prices it, not by the loss after it
        rows = value.shape[:-1].numel()
        handed = graph.call_method("reshape", (handed, rows, value.shape[-1]))
        handed.meta["example_value"] = handed_value = value.reshape(rows, value.shape[-1])
    graph.output((handed, copied[target], *(copied[r] if isinstance(r, fx.Node) else r for r in kept)))
    for node in (loss, *taken):
        graph.erase_node(copied[node])
    graph.lint()
    prefix = fx.GraphModule(gm, graph)
    prefix.meta.update(gm.meta)
    layout, rest = [], iter(range(len(kept)))
    for r in results:
        layout.append(LOSS if r is loss else LOGITS if r is logits else HIDDEN if dense and r is hidden else next(rest))
    split = OwnLoss(prefix, placeholders.index(weight), None if bias is None else placeholders.index(bias), options,
                    tuple(layout))
    return split, handed_value


def _head_and_loss(loss: fx.Node, output: fx.Node) -> tuple | None:
    """Where `loss` is a cross-entropy over an LM head's logits, flattened and in float32
    (cast to it, or as computed), read by nothing else (but the output): the loss, the
    nodes from the flattening up to the logits, the head's input, weight and bias, the
    targets, and the `CausalLMLoss` options of the loss (None where it has none); else
    None."""
    if loss.op != "call_function" or loss.target is not F.cross_entropy or set(loss.users) != {output}:
        return None
    given = cross_entropy_arguments(loss.args, loss.kwargs)
    flat, target = given["input"], given["target"]
    if not (isinstance(flat, fx.Node) and isinstance(target, fx.Node) and set(flat.users) == {loss}
            and _flattening(flat) and isinstance(flat.args[0], fx.Node)):
        return None
    casts = [flat.args[0]]
    while _float32_cast(casts[-1]) and set(casts[-1].users) == {casts[-2] if len(casts) > 1 else flat}:
        casts.append(casts[-1].args[0])
    logits, casts = casts[-1], casts[:-1]
    after = casts[-1] if casts else flat
    if logits.op != "call_function" or logits.target is not F.linear or not set(logits.users) <= {after, output}:
        return None
    hidden, weight, bias = (logits.args[i] if len(logits.args) > i else logits.kwargs.get(name)
                            for i, name in enumerate(("input", "weight", "bias")))
    values = [n.meta.get("example_value") if isinstance(n, fx.Node) else None
              for n in (logits, hidden, target, flat, weight, loss)]
    if not all(isinstance(v, torch.Tensor) for v in values) or any(_symbolic(v) for v in values):
        return None
    out, inputs, targets, rows, head, value = values
    if (rows.dtype != torch.float32 or not out.dtype == inputs.dtype == head.dtype or not inputs.requires_grad
            or not value.requires_grad
            or out.shape[-1] < WIDENING * inputs.shape[-1] or rows.shape != (out.shape[:-1].numel(), out.shape[-1])
            or targets.shape != rows.shape[:1] or targets.dtype not in (torch.long, torch.uint8)):
        return None
    return (loss, [flat, *casts, logits], (hidden, weight, bias if isinstance(bias, fx.Node) else None), target,
            loss_options(given))


def _symbolic(t: torch.Tensor) -> bool:
    """Whether `t`'s shape is symbolic (compiled with dynamic shapes)."""
    return not all(isinstance(d, int) for d in t.shape)


def _float32_cast(node: Any) -> bool:
    """Whether `node` only casts its tensor to float32 (`.float()`, `.to(torch.float32)`,
    `.type(torch.float32)`)."""
    if not isinstance(node, fx.Node) or node.op != "call_method" or not isinstance(node.args[0], fx.Node):
        return False
    rest, kwargs = node.args[1:], node.kwargs
    if node.target == "float":
        return not rest and not kwargs
    return node.target in ("to", "type") and (rest, kwargs) in (((torch.float32,), {}), ((), {"dtype": torch.float32}))


def _flattening(node: fx.Node) -> bool:
    """Whether `node` reshapes a tensor (a view, reshape or flatten)."""
    if node.op == "call_method":
        return node.target in _FLATTENING
    return node.op == "call_function" and node.target in (torch.reshape, torch.flatten)
