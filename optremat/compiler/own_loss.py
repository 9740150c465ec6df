"""A compiled graph's own LM head and cross-entropy, run after it in the plan's chunks.

A model that takes its loss in its forward (nanoGPT's `logits = self.lm_head(x)`, then
`F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))`) hands
torch.compile one graph computing the whole logits. `split_own_loss` finds that head and
loss at the end of the graph dynamo hands the backend: an `F.linear` at least
`WIDENING` times wider than its input, its logits (capped, as Gemma 2 caps them, where
they are in float32) read only by a flattening (after a cast to float32 where they are
not in it, as transformers' loss casts them) and that cross-entropy (and returned), the
loss returned, or scaled or added to by scalars on the way (divided by
`num_items_in_batch`, an auxiliary loss added): nanoGPT's, and a transformers Llama's
own loss compiled whole. Its `prefix` is the graph without them,
returning the head's input and the targets besides; its `loss` is the `CausalLMLoss`
over the head's weight that computes the same loss from them, for the backend to plan
the prefix with (its chunks chosen with the plan, `Partitioner._chunked`); `run` runs
the compiled prefix, then that loss in the chunks chosen, then the graph's nodes after
the loss (its `suffix`, uncompiled: scalar work), and returns what the graph returns,
the logits None (the loss alone read them, as `CausalLMLoss` and the native runtime's
deferred head return them).
"""

from __future__ import annotations

import operator
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


@dataclass(frozen=True)
class OwnLoss:
    """A graph's head and loss taken out of it (`split_own_loss`): `prefix` computes the
    rest, returning the head's input, the targets and what `suffix` reads; `suffix` takes
    the loss, the head's input, those and the call's arguments and returns the graph's
    outputs (the loss scaled or added to where the graph does so, the logits None);
    `weight` and `bias` index the graph's inputs holding the head's; `options` are the
    `CausalLMLoss` options computing the loss."""

    prefix: fx.GraphModule
    suffix: fx.GraphModule
    weight: int
    bias: int | None
    options: dict[str, Any]

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
        whole), then the suffix, returning the graph's outputs with the logits None."""

        def step(*args: Any) -> Any:
            hidden, target, *read = prefix(*args)
            with torch.autocast(hidden.device.type, enabled=False):  # the graph's head ran in its weight's dtype
                loss = self.loss(args, target.reshape(hidden.shape[:-1]), chunks)(hidden)
            return self.suffix(loss, hidden, *read, *args)

        return step


def split_own_loss(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[OwnLoss, torch.Tensor] | None:
    """The head and loss at the end of `gm` taken out of it, and the head input's example
    value; None where the graph has none (or its loss takes no gradient), where the head's
    input shares its storage with another output (a view of it is not handed to the loss
    the prefix is priced with, so it would not be priced), where the head's input is one
    of the graph's or a view of one (a graph break before the head: nothing before it to
    plan, and AOTAutograd hands no output aliasing an input to the loss priced), or where
    the graph returns the logits to the rest of a forward a graph break cut
    (`_continued`)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    results = output.args[0]
    if not isinstance(results, (tuple, list)):
        return None
    found = {}
    for node in gm.graph.nodes:
        head = _head_and_loss(node, output) if node.op == "call_function" and node.target is F.cross_entropy else None
        if head is not None:
            found[node] = head
    if len(found) != 1:
        return None
    loss, (taken, logits, (hidden, weight, bias), target, options, tail) = next(iter(found.items()))
    if logits in results and _continued(gm):
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if (weight not in placeholders or (bias is not None and bias not in placeholders)
            or _storage(hidden) in {_storage(p) for p in placeholders}):
        return None
    value = hidden.meta["example_value"]
    dense = value.is_contiguous()
    dropped = {loss, logits, *tail, *([hidden] if dense else [])}
    read = [r for r in results if isinstance(r, fx.Node) and r not in dropped]
    read += [n for t in tail for n in t.all_input_nodes if n not in dropped and n not in placeholders]
    read = list(dict.fromkeys(read))
    if (options is None or not isinstance(example_inputs[placeholders.index(weight)], torch.Tensor)
            or _storage(hidden) in {_storage(r) for r in read}):
        return None
    prefix, handed = _prefix(gm, (*reversed(tail), loss, *taken), hidden, target, read)
    suffix = _suffix(gm, loss, hidden if dense else None, logits, tail, read, placeholders)
    split = OwnLoss(prefix, suffix, placeholders.index(weight), None if bias is None else placeholders.index(bias),
                    options)
    return split, handed


def _continued(gm: fx.GraphModule) -> bool:
    """Whether dynamo ended `gm` at a graph break (or does not say), so that its outputs
    feed the rest of the forward, which may read the logits, not only the caller."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    return reason is None or reason.graph_break


def _prefix(gm: fx.GraphModule, taken: Sequence[fx.Node], hidden: fx.Node, target: fx.Node,
            read: Sequence[fx.Node]) -> tuple[fx.GraphModule, torch.Tensor]:
    """`gm` without the nodes `taken` (each before those it reads), returning the head's
    input (2-d where it is not dense: copied inside the graph, where the plan prices it,
    not by the loss after it), the targets and `read`; and the example value of the
    head's input it returns."""
    graph = fx.Graph()
    copied: dict[fx.Node, fx.Node] = {}
    graph.graph_copy(gm.graph, copied)
    handed, value = copied[hidden], hidden.meta["example_value"]
    if not value.is_contiguous():
        rows = value.shape[:-1].numel()
        handed = graph.call_method("reshape", (handed, rows, value.shape[-1]))
        handed.meta["example_value"] = value = value.reshape(rows, value.shape[-1])
    graph.output((handed, copied[target], *(copied[r] for r in read)))
    for node in taken:
        graph.erase_node(copied[node])
    graph.lint()
    prefix = fx.GraphModule(gm, graph)
    prefix.meta.update(gm.meta)
    return prefix, value


def _suffix(gm: fx.GraphModule, loss: fx.Node, hidden: fx.Node | None, logits: fx.Node, tail: Sequence[fx.Node],
            read: Sequence[fx.Node], placeholders: Sequence[fx.Node]) -> fx.GraphModule:
    """The graph taking the loss, the head's input (`hidden`, None where the graph does
    not return it as the prefix hands it), `read` and `gm`'s arguments, running the
    `tail` of nodes after the loss, and returning `gm`'s outputs with the logits None."""
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {logits: None}
    named = [("loss", loss), ("head_input", hidden), *((f"read_{i}", n) for i, n in enumerate(read)),
             *((f"argument_{i}", n) for i, n in enumerate(placeholders))]
    for name, node in named:
        env[node] = graph.placeholder(name)
    for node in tail:
        env[node] = graph.node_copy(node, lambda n: env[n])
    output = next(n for n in gm.graph.nodes if n.op == "output")
    graph.output(fx.map_arg(output.args[0], lambda n: env[n]))
    graph.lint()
    return fx.GraphModule(gm, graph)


def _head_and_loss(loss: fx.Node, output: fx.Node) -> tuple | None:
    """Where `loss` is a cross-entropy over an LM head's logits, capped or not (`_softcap`),
    flattened and in float32 (cast to it, or as computed), read by nothing else (but the
    output), and the loss is returned, or scaled or added to on the way (`_tail`): the
    nodes from the flattening up to the head, the logits it may return, the head's input,
    weight and bias, the targets, the `CausalLMLoss` options of the loss (None where it
    has none) and the tail; else None."""
    tail = _tail(loss, output)
    if tail is None:
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
    if not set(logits.users) <= {after, output}:
        return None
    capping, softcap = _softcap(logits) or ([], None)
    linear = capping[-1].args[0] if capping else logits
    if (linear.op != "call_function" or linear.target is not F.linear
            or (capping and set(linear.users) != {capping[-1]})):
        return None
    hidden, weight, bias = (linear.args[i] if len(linear.args) > i else linear.kwargs.get(name)
                            for i, name in enumerate(("input", "weight", "bias")))
    values = [n.meta.get("example_value") if isinstance(n, fx.Node) else None
              for n in (linear, hidden, target, flat, weight, loss)]
    if not all(isinstance(v, torch.Tensor) for v in values) or any(_symbolic(v) for v in values):
        return None
    out, inputs, targets, rows, head, value = values
    if (rows.dtype != torch.float32 or not out.dtype == inputs.dtype == head.dtype or not inputs.requires_grad
            or not value.requires_grad
            or out.shape[-1] < WIDENING * inputs.shape[-1] or rows.shape != (out.shape[:-1].numel(), out.shape[-1])
            or targets.shape != rows.shape[:1] or targets.dtype not in (torch.long, torch.uint8)):
        return None
    options = loss_options(given)
    if options is not None and softcap is not None:
        options["softcap"] = softcap
    return ([flat, *casts, *capping, linear], logits, (hidden, weight, bias if isinstance(bias, fx.Node) else None),
            target, options, tail)


def _softcap(node: fx.Node) -> tuple[list[fx.Node], float] | None:
    """Where `node` caps logits as Gemma 2 does, `c * tanh(x / c)`: its product, tanh and
    quotient, each read only by the next, and c; else None. The chunks cap them so in the
    head's dtype before the cast (`CausalLMLoss(softcap=c)`)."""
    if node.op != "call_function" or node.target not in (operator.mul, torch.mul) or len(node.args) != 2:
        return None
    tanh, cap = node.args if isinstance(node.args[0], fx.Node) else node.args[::-1]
    if (not isinstance(tanh, fx.Node) or set(tanh.users) != {node} or not isinstance(cap, (int, float))
            or isinstance(cap, bool) or cap <= 0
            or not ((tanh.op == "call_function" and tanh.target is torch.tanh)
                    or (tanh.op == "call_method" and tanh.target == "tanh"))):
        return None
    quotient = tanh.args[0]
    if (not isinstance(quotient, fx.Node) or quotient.op != "call_function" or set(quotient.users) != {tanh}
            or quotient.target not in (operator.truediv, torch.div) or quotient.kwargs
            or len(quotient.args) != 2 or not isinstance(quotient.args[0], fx.Node) or quotient.args[1] != cap):
        return None
    return [node, tanh, quotient], float(cap)


def _tail(loss: fx.Node, output: fx.Node) -> list[fx.Node] | None:
    """The nodes computed from `loss` on its way to the output, in graph order: the loss
    divided by `num_items_in_batch`, or an auxiliary loss added to it; None where one of
    them, or a value one of them reads, is more than a scalar tensor (the suffix running
    them is not priced), or is not a function's or a method's, where none of them is
    returned, or where they do not all run with gradients and nothing else set
    (`_run_as_suffix`), as the suffix runs them, or where running them after the rest
    of the graph reorders a write (`_reorders_writes`)."""
    tail: dict[fx.Node, None] = {}
    reached = [loss]
    while reached:
        for user in reached.pop().users:
            if user is not output and user not in tail:
                tail[user] = None
                reached.append(user)
    nodes = list(loss.graph.nodes)
    if (not any(output in n.users for n in (loss, *tail)) or not _run_as_suffix(tail, nodes, loss)
            or _reorders_writes(tail, nodes, loss)):
        return None
    for node in tail:
        if node.op not in ("call_function", "call_method") or not all(
                _scalar(n) for n in (node, *node.all_input_nodes) if n is not loss):
            return None
    return sorted(tail, key=nodes.index)


def _run_as_suffix(tail: Sequence[fx.Node], nodes: Sequence[fx.Node], loss: fx.Node) -> bool:
    """Whether the graph's `nodes` run its `tail` as the suffix runs it: with gradients
    (as at the loss), outside any autocast enabled, and with nothing else set after the
    loss (a call returning no tensor, read by nothing)."""
    enabled, casting, after = True, [], False
    for node in nodes:
        if node.op != "call_function":
            pass
        elif node.target is torch.amp.autocast_mode._enter_autocast:
            casting.append(bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("enabled", True)))
        elif node.target is torch.amp.autocast_mode._exit_autocast:
            if not casting:  # entered before the graph: its state is not read here
                return False
            casting.pop()
        elif node.target is torch._C._set_grad_enabled:
            enabled = bool(node.args[0])
        elif after and not node.users and not isinstance(node.meta.get("example_value"), torch.Tensor):
            return False
        if node in tail and not (enabled and not any(casting)):
            return False
        if node is loss:
            enabled, after = True, True
    return True


def _reorders_writes(tail: Sequence[fx.Node], nodes: Sequence[fx.Node], loss: fx.Node) -> bool:
    """Whether running the `tail` after the rest of the graph would move a write across a
    read: a tail node writing a tensor from outside the tail (a running baseline updated
    with the loss), or reading one the graph writes (that baseline, updated before)."""
    own = {loss, *tail}
    written = set()
    for node in nodes:
        target = _written(node)
        if target is not None:
            if node in own and target not in own:
                return True
            written.add(_storage(target))
    return any(_storage(n) in written for node in tail for n in node.all_input_nodes if n not in own)


_IN_PLACE_OPERATORS = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                       operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                       operator.irshift, operator.imatmul)


def _written(node: fx.Node) -> fx.Node | None:
    """The node whose tensor `node` writes in place (`x.add_(y)`, `x += y`, `out=x`,
    `inplace=True`), or None."""
    if node.op not in ("call_function", "call_method"):
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    out = node.kwargs.get("out")
    if isinstance(out, fx.Node):
        return out
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if (node.target in _IN_PLACE_OPERATORS or node.kwargs.get("inplace") is True
            or (isinstance(name, str) and name.endswith("_") and not name.startswith("_"))):
        return first
    return None


def _storage(node: fx.Node) -> Any:
    """What identifies the storage of `node`'s tensor (the node itself where it has none)."""
    value = node.meta.get("example_value")
    return StorageWeakRef(value.untyped_storage()) if isinstance(value, torch.Tensor) else node


def _scalar(node: fx.Node) -> bool:
    """Whether `node`'s value is a tensor of at most one element."""
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.numel() <= 1


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
