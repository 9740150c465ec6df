"""AOTAutograd's joint forward+backward graph as the Graph optremat plans.

Inside `torch.compile`, AOTAutograd traces the step into one fx graph: placeholders
`primals_*` (parameters, buffers and inputs, the first `static` of them living beyond
the step) and `tangents_*` (the gradients of the outputs), forward ops, backward ops and
an output node listing the forward outputs, then the gradients. That is the graph
`optremat.extract` traces itself, so it becomes a Graph the same way (`extract.to_graph`);
what differs is how forward and backward are told apart: a node is forward when the
forward outputs need it (PyTorch's own `classify_nodes`), everything else runs in the
backward. The outputs handed to the user live until the loss has used them (the first op
reading an output's gradient reads them too), not to the end of the step: a training
loop drops the model's output once it has the loss.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
import torch
import torch._guards
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput
from torch._functorch.partitioners import _is_primal, _is_tangent, classify_nodes
from torch.utils._pytree import arg_tree_leaves

from optremat.costs import DeviceProfile, roofline_cost
from optremat.extract import BATCH_NORMS, ExtractionError, assumed_loss, depending_on, output_loss_bytes, to_graph
from optremat.graph import Graph
from optremat.runtime.ops import is_random


@dataclass(frozen=True)
class JointStep:
    """The Graph of a joint graph, `nodes[i]` the fx node of Graph node i.

    `fixed` marks nodes that must run exactly once, where the joint graph has them:
    random ops (a second run would draw other numbers), ops that write in place and ops
    that read an input the step mutates (after the forward, a recomputation would read
    the new value). Batch norms are the exception: in training they read the running
    statistics the step updates (`mutated`, the names of those inputs) only to compute
    the update, which a recomputation drops, so they may run again. The first op that
    reads an output's gradient is fixed too: it carries the loss's memory, which is
    spent once.
    """

    graph: Graph
    nodes: tuple[torch.fx.Node, ...]
    fixed: np.ndarray
    mutated: frozenset[str] = frozenset()


def read_joint(joint: torch.fx.GraphModule, num_fwd_outputs: int, static_inputs: list[int],
               profile: DeviceProfile, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> JointStep:
    """The step `joint` computes, with room for the loss computed on its forward outputs
    between its forward and its backward (`loss_fn`, or a cross-entropy over the largest
    output's last dimension, `extract.assumed_loss`, when none is given)."""
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
    ordered = (placeholders + [n for n in joint.graph.nodes if n.op == "get_attr"]
               + [n for n in others if n in forward] + [n for n in others if n not in forward])
    primals = [n for n in placeholders if _is_primal(n)]
    static = {primals[i] for i in static_inputs}
    kinds = ["param" if n in static else "input" for n in placeholders]
    output = next(n for n in joint.graph.nodes if n.op == "output")
    results = arg_tree_leaves(*output.args)
    descs = output.meta.get("desc") or [None] * len(results)
    handed = [n for n, d in zip(results[:num_fwd_outputs], descs) if isinstance(n, torch.fx.Node)
              and not isinstance(d, InputMutationAOTOutput)]
    loss_at = _first_reader(ordered, [n for n in placeholders if _is_tangent(n)])
    kept = [n for n in results if isinstance(n, torch.fx.Node) and (loss_at is None or n not in handed)]
    costs = {n.name: roofline_cost(n, profile) for n in others}
    graph = to_graph(ordered, kinds, [], costs, kept, lambda node: node in others and node not in forward,
                     [] if loss_at is None else [(n, loss_at) for n in handed])
    nodes = tuple(ordered)
    mutated = _mutated_inputs(joint, primals)
    fixed = np.array([is_random(n) or _writes_in_place(n) or _reads_stale(n, mutated) or n is loss_at
                      for n in nodes], dtype=bool)
    tangents = [i for i, n in enumerate(nodes) if _is_tangent(n)]
    return JointStep(_with_loss(graph, tangents, [n.meta["val"] for n in placeholders if _is_tangent(n)],
                                loss_fn, profile), nodes, fixed, frozenset(n.name for n in mutated))


def _first_reader(ordered: list[torch.fx.Node], sources: list[torch.fx.Node]) -> torch.fx.Node | None:
    """The first op in `ordered` (a topological order) that depends on one of `sources`:
    it reads one of them directly."""
    return next((n for n in ordered if n.op == "call_function" and set(sources).intersection(n.all_input_nodes)),
                None)


def _with_loss(graph: Graph, tangents: list[int], tangent_values: list[Any],
               loss_fn: Callable[[Any], torch.Tensor] | None, profile: DeviceProfile) -> Graph:
    """`graph` with the loss's bytes as the workspace of the first op that reads an
    output's gradient: the loss runs in eager autograd between the compiled forward and
    backward, so that is when those bytes are live."""
    readers = depending_on(graph, tangents)
    if not readers.any() or not tangent_values:
        return graph
    with unset_fake_temporarily(), torch._guards.tracing(None), torch.enable_grad():
        out = [torch.empty(t.shape, dtype=t.dtype, device=t.device, requires_grad=t.is_floating_point())
               for t in tangent_values]
        loss = output_loss_bytes(out[0] if len(out) == 1 else out, loss_fn or assumed_loss, device=profile,
                                 output_released=True)
    workspace = graph.workspace.copy()
    workspace[int(np.argmax(readers))] += loss
    workspace.flags.writeable = False
    return replace(graph, workspace=workspace)


def _mutated_inputs(joint: torch.fx.GraphModule, primals: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """The primals whose data the compiled step writes: AOTAutograd returns their new
    values as forward outputs, described as input mutations."""
    output = next(n for n in joint.graph.nodes if n.op == "output")
    targets = [d.mutated_input for d in output.meta.get("desc") or () if isinstance(d, InputMutationAOTOutput)]
    return {p for p in primals if p.meta.get("desc") is not None and p.meta["desc"] in targets}


def _reads_stale(node: torch.fx.Node, mutated: set[torch.fx.Node]) -> bool:
    if node.op != "call_function" or not mutated.intersection(node.all_input_nodes):
        return False
    return not str(node.target).removeprefix("aten.").startswith(BATCH_NORMS)


def _symbolic(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in value.shape)


def _writes_in_place(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable
