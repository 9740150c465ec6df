"""AOTAutograd's joint forward+backward graph as the Graph optremat plans.

Inside `torch.compile`, AOTAutograd traces the step into one fx graph: placeholders
`primals_*` (parameters, buffers and inputs, the first `static` of them living beyond
the step) and `tangents_*` (the gradients of the outputs), forward ops, backward ops and
an output node listing the forward outputs, then the gradients. That is the graph
`optremat.extract` traces itself, so it becomes a Graph the same way (`extract.to_graph`);
what differs is how forward and backward are told apart: a node is forward when the
forward outputs need it (PyTorch's own `classify_nodes`), everything else runs in the
backward. Between the two runs the loss, in eager autograd: it becomes a node of the
Graph (see `JointStep`): the outputs handed to the user live to the end of the step, as
a training loop holding `out = model(x)` through `loss.backward()` holds them (the native
plans price them so too), and the outputs' gradients exist from the loss on, not from the
start.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Collection

import numpy as np
import torch
import torch._guards
import torch.fx
from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput, PlainAOTOutput
from torch._functorch.partitioners import _is_primal, _is_tangent, classify_nodes
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import arg_tree_leaves

from optremat.core.graph import Graph
from optremat.runtime.ops import is_random
from optremat.tracing.costs import DeviceProfile, profile_costs, roofline_cost, runs_on_cpu
from optremat.tracing.extract import (BATCH_NORMS, ExtractionError, LossPrice, assumed_loss, is_view, mutated_inputs,
                                      output_loss_price, to_graph)

_DYNAMO_ROOT = re.compile(r"^L(\[[^\]]*\])+")
_SUBSCRIPT = re.compile(r"(?:\._modules)?\[['\"]?([^'\"\]]*)['\"]?\]")

LOSS = "optremat_loss"
"""The name of the Graph node that stands for the loss."""

OUTSIDE = "optremat_outside"
"""The name of the Graph node that stands for the tensors outside the compiled graph that
the loss reads and takes gradients for (a head's weight): resident through the step."""


@dataclass(frozen=True)
class JointStep:
    """The Graph of a joint graph and its fx nodes by name.

    `fixed` marks the Graph's nodes that must run exactly once, where the joint graph has them:
    random ops (a second run would draw other numbers), ops that write in place and ops
    that read an input the step mutates (after the forward, a recomputation would read
    the new value). Batch norms are the exception: in training they read the running
    statistics the step updates (`mutated`, the names of those inputs) only to compute
    the update, which a recomputation drops, so they may run again.

    `graph` also holds a node for the loss (named `LOSS`, with no fx node): it reads the
    outputs handed to the user, holds the loss's memory as its workspace and costs what
    its forward and backward do (so a step whose loss runs in chunks is priced as it
    runs); the outputs'
    gradients (the `tangents_*` placeholders) are computed by it, so they are allocated
    when the loss has run and freed after their last read, not resident for the whole
    step. The loss is an output the size of the gradients it gives tensors outside the
    graph (an LM head's weight the loss reads: autograd holds its gradient to the step's
    end), and the gradients are fixed, so no plan computes either twice. The tensors the
    loss takes gradients for that the compiled graph does not take (an untied head's
    weight) are one resident node, `OUTSIDE`.
    """

    graph: Graph
    nodes: dict[str, torch.fx.Node]
    fixed: np.ndarray
    mutated: frozenset[str] = frozenset()


def read_joint(joint: torch.fx.GraphModule, num_fwd_outputs: int, static_inputs: list[int],
               profile: DeviceProfile, loss_fn: Callable[[Any], torch.Tensor] | None = None,
               cost_model: str = "roofline", graph_inputs: Collection[int] = ()) -> JointStep:
    """The step `joint` computes, with room for the loss computed on its forward outputs
    between its forward and its backward (`loss_fn`; when none is given, the loss the
    graph computes and returns itself, `_own_loss`, else a cross-entropy over the largest
    output's last dimension, `extract.assumed_loss`). Its ops cost what
    the roofline over `profile` says, or with `cost_model="profile"` what they take when
    timed here (`timed_costs`). A tensor the loss takes a gradient for that is not among
    the compiled graph's inputs (`graph_inputs`, the ids of the tensors it was compiled
    with: an LM head outside it) is resident through the step, a node `OUTSIDE`."""
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    if any(not _is_primal(n) and not _is_tangent(n) for n in placeholders):
        names = [n.name for n in placeholders if not _is_primal(n) and not _is_tangent(n)]
        raise ExtractionError(f"the joint graph has inputs optremat does not plan ({', '.join(names)}); "
                              "compile without functionalized RNG or backward hooks")
    if any(isinstance(n.meta.get("val"), torch.SymInt) or _symbolic(n.meta.get("val")) for n in placeholders):
        raise ExtractionError("the compiled graph has dynamic shapes; optremat plans one shape per graph: "
                              "compile with dynamic=False (each new shape then gets its own plan)")
    info = classify_nodes(joint, static_inputs, num_fwd_outputs)
    others = [n for n in joint.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    # every output of a forward op is taken in the forward, so the op's tuple dies there
    forward = {n for n in others if info.is_required_fw(n)
               or (n.target is operator.getitem and info.is_required_fw(n.args[0]))}
    primals = [n for n in placeholders if _is_primal(n)]
    tangents = [n for n in placeholders if _is_tangent(n)]
    ordered = (primals + [n for n in joint.graph.nodes if n.op == "get_attr"] + [n for n in others if n in forward]
               + tangents + [n for n in others if n not in forward])
    static = {primals[i] for i in static_inputs}
    kinds = ["param" if n in static else "input" for n in primals] + ["op"] * len(tangents)
    output = next(n for n in joint.graph.nodes if n.op == "output")
    results = arg_tree_leaves(*output.args)
    descs = output.meta.get("desc") or [None] * len(results)
    handed = [n for n, d in zip(results[:num_fwd_outputs], descs) if isinstance(n, torch.fx.Node)
              and not isinstance(d, InputMutationAOTOutput)]
    kept = [n for n in results if isinstance(n, torch.fx.Node)]
    costs = (timed_costs(joint, placeholders) if cost_model == "profile"
             else {n.name: roofline_cost(n, profile) for n in others})
    backward = set(tangents) | (set(others) - forward)
    graph = to_graph(ordered, kinds, [], costs, kept, backward.__contains__, cpu=runs_on_cpu(profile))
    graph = replace(graph, module=tuple(_module_path(n) for n in ordered))
    mutated = _mutated_inputs(joint, primals)
    fixed = [is_random(n) or bool(mutated_inputs(n)) or _reads_stale(n, mutated) or _is_tangent(n) for n in ordered]
    if tangents:
        at = ordered.index(tangents[0])
        own = _own_loss(tangents, handed) if loss_fn is None else None
        if own is not None:
            loss_fn = lambda out: out if isinstance(out, torch.Tensor) else out[own]  # noqa: E731
        loss = _loss_price([n.meta["val"] for n in tangents], loss_fn, profile, cost_model)
        graph = _with_loss_node(graph, at, [ordered.index(n) for n in handed], loss, len(tangents))
        fixed.insert(at, False)
        resident = sum(t.numel() * t.element_size() for t in loss.outside if id(t) not in graph_inputs)
        if resident:
            graph = graph.with_node(len(primals), name=OUTSIDE, op="outside", kind="param", size=resident,
                                    backward=False, output=False)
            fixed.insert(len(primals), False)
    return JointStep(graph, {n.name: n for n in ordered}, np.array(fixed, dtype=bool),
                     frozenset(n.name for n in mutated))


_LOSS_OPS = ("nll_loss", "mse_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "kl_div",
             "soft_margin_loss", "multi_margin_loss", "multilabel_margin_loss", "_ctc_loss", "ctc_loss")
"""The aten ops of PyTorch's loss functions (cross-entropy's is nll_loss's)."""


def _own_loss(tangents: list[torch.fx.Node], handed: list[torch.fx.Node]) -> int | None:
    """The position among `tangents` of the gradient of the loss the graph computes itself,
    as `inputs.own_loss` finds `outputs.loss` in eager: the one floating-point scalar
    output taking a gradient, computed by a loss op (`_LOSS_OPS`) from another output
    handed out (the logits, or what they view); else None. The step differentiates that
    output, so nothing runs between the forward and the backward: a cross-entropy over
    the logits (`assumed_loss`) would price a loss never run (a bfloat16 Llama's step
    predicted 9% over its measured peak)."""
    outputs = []
    for tangent in tangents:
        of = getattr(tangent.meta.get("desc"), "output", None)
        outputs.append(handed[of.idx] if isinstance(of, PlainAOTOutput) and of.idx < len(handed) else None)
    scalars = [k for k, n in enumerate(outputs) if n is not None and isinstance(v := n.meta.get("val"), torch.Tensor)
               and v.dim() == 0 and v.is_floating_point()]
    if len(scalars) != 1:
        return None
    loss = outputs[scalars[0]]
    others = set()
    for node in handed:
        while isinstance(node, torch.fx.Node) and node is not loss and node not in others:
            others.add(node)
            # a view of its first input, or the reshape of a product's result (`_unsafe_view`)
            node = node.args[0] if is_view(node) or node.target is torch.ops.aten._unsafe_view.default else None
    seen, stack = set(), [(loss, False)]
    while stack:
        node, through = stack.pop()
        if (node, through) in seen:
            continue
        seen.add((node, through))
        if through and node in others:
            return scalars[0]
        through = through or _op_name(node).startswith(_LOSS_OPS)
        stack.extend((p, through) for p in node.all_input_nodes)
    return None


def _op_name(node: torch.fx.Node) -> str:
    """The aten op a node calls, without its overload (`nll_loss_forward`), or ""."""
    return getattr(node.target, "__name__", str(node.target)).split(".")[0] if node.op == "call_function" else ""


def timed_costs(joint: torch.fx.GraphModule, placeholders: list[torch.fx.Node]) -> dict[str, float]:
    """Seconds each op of `joint` takes on this machine (`costs.profile_costs`), run on
    tensors shaped like its inputs: floating-point ones drawn at random, the others zero,
    so that indices and targets stay in range."""
    with unset_fake_temporarily(), torch._guards.tracing(None), torch.no_grad():
        return profile_costs(joint, [_real_like(n.meta["val"]) for n in placeholders])


def _real_like(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    real = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    return real.normal_() if real.is_floating_point() else real.zero_()


def _loss_price(tangent_values: list[Any], loss_fn: Callable[[Any], torch.Tensor] | None,
                profile: DeviceProfile, cost_model: str) -> LossPrice:
    """What the loss, run by eager autograd between the compiled forward and backward on
    outputs shaped like the gradients `tangent_values`, holds beyond them at its peak,
    and what it costs."""
    with unset_fake_temporarily(), torch._guards.tracing(None), torch.enable_grad():
        out = [torch.empty(t.shape, dtype=t.dtype, device=t.device, requires_grad=t.is_floating_point())
               for t in tangent_values]
        return output_loss_price(out[0] if len(out) == 1 else out, loss_fn or assumed_loss, device=profile,
                                 cost_model=cost_model)


def _with_loss_node(graph: Graph, at: int, reads: list[int], loss: LossPrice, gradients: int) -> Graph:
    """`graph` with the loss (see `JointStep`) inserted as node `at`, reading `reads` and
    producing the `gradients` nodes that had indices `at` onwards."""
    # the node holds its size from when it runs and its workspace while it runs: the gradients
    # outside the graph, made by the loss's end, are held on, and its peak stays the loss's own
    return graph.with_node(at, name=LOSS, op="loss", kind="op", cost=loss.cost, size=loss.gradients,
                           workspace=max(loss.bytes - loss.gradients, 0), backward=True, output=True, reads=reads,
                           feeds=[at + k for k in range(gradients)])


def _module_path(node: torch.fx.Node) -> str:
    """The path of the innermost module that ran `node` in the compiled model
    (`model.layers.3.mlp`), from Dynamo's record of it; "" for ops outside any (the
    backward's among them)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = _DYNAMO_ROOT.sub("", list(stack.values())[-1][0])
    return _SUBSCRIPT.sub(lambda m: "." + m.group(1), path).lstrip(".")


def _mutated_inputs(joint: torch.fx.GraphModule, primals: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """The primals whose data the compiled step writes: AOTAutograd returns their new
    values as forward outputs, described as input mutations, or (with mutations kept in
    the graph, as `keep_inference_input_mutations` keeps them) an op writes them there,
    `copy_(primal, new)`: an op reading one before that write must not be recomputed."""
    output = next(n for n in joint.graph.nodes if n.op == "output")
    targets = [d.mutated_input for d in output.meta.get("desc") or () if isinstance(d, InputMutationAOTOutput)]
    written = {w for n in joint.graph.nodes if n.op == "call_function" for w in mutated_inputs(n)}
    return {p for p in primals if (p.meta.get("desc") is not None and p.meta["desc"] in targets) or p in written}


def _reads_stale(node: torch.fx.Node, mutated: set[torch.fx.Node]) -> bool:
    if node.op != "call_function" or not mutated.intersection(node.all_input_nodes):
        return False
    return not str(node.target).removeprefix("aten.").startswith(BATCH_NORMS)


def _symbolic(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in value.shape)
