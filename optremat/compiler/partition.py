"""A schedule of the joint graph as AOTAutograd's forward and backward graphs.

The schedule is written out as a new joint graph, one fx node per computation event in
the schedule's order, so an op the schedule computes twice appears twice (the second
copy reading the copies current at that point). Events before the first one that reads
an output's gradient form the forward; the forward copies the backward reads (and the
primals it reads) are the saved values. PyTorch's own `_extract_fwd_bwd_modules` then
cuts the forward and backward modules out of that graph with AOTAutograd's conventions
(saved tensors, symbols, tangents), keeping each module's nodes in the schedule's order:
fx frees every value after its last use, so the forward and backward hold what the
simulator prices. A computation the plan shares runs as its op's out= overload writing
over the input it is the last to hold, so it allocates nothing, as priced.
"""

from __future__ import annotations

import operator

import numpy as np
import torch
import torch.fx as fx
from torch._functorch.compile_utils import raise_getitems
from torch._functorch.partitioners import _extract_fwd_bwd_modules, _is_primal, _is_tangent
from torch.utils._pytree import arg_tree_leaves

from optremat.compiler.joint import JointStep
from optremat.core.graph import Graph
from optremat.core.schedule import Schedule
from optremat.runtime.ops import is_random, out_variant
from optremat.tracing.extract import depending_on


def writable(step: JointStep, graph: Graph) -> np.ndarray:
    """The nodes of `graph` (the step's Graph, perhaps renumbered) that can write their
    output over the input `Graph.shareable` names: an op with an out= overload whose
    output has that input's shape, dtype and strides, the input's storage an op's result
    (not a primal's or an output's gradient's, which the caller may still hold: a view of
    the gradient autograd hands the backward was written over, and the caller's tensor,
    and every other branch reading it, with it)."""
    nodes = [step.nodes.get(name) for name in graph.names]
    mask = np.zeros(graph.n, dtype=bool)
    for k in np.nonzero(graph.shareable >= 0)[0].tolist():
        node, source = nodes[k], nodes[int(graph.shareable[k])]
        owner = nodes[int(graph.storage_root[int(graph.shareable[k])])]
        if (node is None or source is None or owner is None or source.op != "call_function"
                or owner.op != "call_function" or out_variant(node.target) is None):
            continue
        out, into = node.meta.get("val"), source.meta.get("val")
        mask[k] = (isinstance(out, torch.Tensor) and isinstance(into, torch.Tensor) and out.shape == into.shape
                   and out.dtype == into.dtype and out.stride() == into.stride())
    return mask


def partition(joint: fx.GraphModule, step: JointStep, graph: Graph, schedule: Schedule,
              num_fwd_outputs: int, shared: dict[int, int] | None = None) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward and backward modules that run `schedule` (of `graph`, the step's
    Graph perhaps renumbered) on `joint`'s ops; each computation in `shared` (an event
    index) writes its output over the input node it names (see `writable`)."""
    nodes = [step.nodes.get(name) for name in graph.names]
    readers = depending_on(graph, [i for i, n in enumerate(nodes) if n is not None and _is_tangent(n)])
    new = fx.Graph()
    current: dict[fx.Node, fx.Node] = {}
    for node in joint.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            current[node] = new.node_copy(node)
    forward = {copy for node, copy in current.items() if node.op == "get_attr" or _is_primal(node)}
    first: dict[fx.Node, fx.Node] = {}
    saved: dict[fx.Node, None] = {}
    in_forward = True
    shared = shared or {}
    for event, (k, s, _) in enumerate(schedule.events):
        node = nodes[k]
        if node is None or node.op != "call_function":
            continue
        in_forward = in_forward and not readers[s]
        copy = new.node_copy(node, lambda arg: current[arg])
        if event in shared:
            copy.target, out = out_variant(node.target)
            copy.kwargs = {**copy.kwargs, out: current[nodes[shared[event]]]}
            # PyTorch's extraction keeps a mutating op in the forward unless it is tagged backward, and
            # refuses one tagged so there (an op of a backward formula reading no gradient, norm's
            # masked_fill, runs in the forward)
            if not in_forward:
                copy.meta["partitioner_tag"] = "is_backward"
            elif copy.meta.get("partitioner_tag") == "is_backward":
                del copy.meta["partitioner_tag"]
        current[node] = copy
        first.setdefault(node, copy)
        if in_forward or (node.target is operator.getitem and copy.args[0] in forward):
            # an output of a forward op is taken in the forward: the op's tuple is never saved
            forward.add(copy)
        else:
            saved.update((arg, None) for arg in copy.all_input_nodes if arg in forward)
            for arg in copy.all_input_nodes:
                if arg.name in step.mutated:
                    # a batch norm rerun reads the running statistics after their update (see JointStep)
                    arg.meta["saved_tensor_with_no_vc_check"] = True
    output = next(n for n in joint.graph.nodes if n.op == "output")
    results = arg_tree_leaves(*output.args)
    fwd, bwd = results[:num_fwd_outputs], results[num_fwd_outputs:]
    mapped = [first.get(v, current.get(v)) if isinstance(v, fx.Node) else v for v in fwd]
    mapped += [current[v] if isinstance(v, fx.Node) else v for v in bwd]
    new.output(tuple(mapped)).meta = dict(output.meta)
    scheduled = fx.GraphModule(joint, new)
    fw_module, bw_module = _extract_fwd_bwd_modules(scheduled, list(saved), saved_sym_nodes=[],
                                                    num_fwd_outputs=num_fwd_outputs)
    return raise_getitems(_without_unread_random(fw_module)), raise_getitems(_without_unread_random(bw_module))


def _without_unread_random(module: fx.GraphModule) -> fx.GraphModule:
    """`module` without the random ops whose results nothing reads. PyTorch's extraction
    copies into a module every op whose inputs it holds, then drops those nothing reads,
    but for random ops, which it must keep: a backward holding a dropout's input (saved
    for another reader) reran the dropout, unread, and drew from the generator every
    step, so every later random number differed from the unplanned step's."""
    graph = module.graph
    for node in reversed(list(graph.nodes)):
        unread = node.op == "call_function" and not node.users
        if unread and (is_random(node) or (node.target is operator.getitem and is_random(node.args[0]))):
            graph.erase_node(node)
    module.recompile()
    return module
