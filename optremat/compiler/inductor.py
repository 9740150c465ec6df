"""Which ops of a planned step Inductor computes inside the kernels that read them.

Inductor does not run a pointwise op where the graph puts it: it inlines the op's
expression into each kernel that reads its result, and allocates the result only when
it must ("realizes" it): when the graph returns it (a tensor saved for the backward, a
gradient), when a reader is not itself a pointwise op, a view or a reduction (a matmul,
a convolution, anything called as an extern kernel), or when several kernels read it
and inlining it into each would be costly (`torch._inductor.graph.GraphLowering.run_node`
and `StorageBox.should_realize_on_reuse`). An inlined op allocates nothing, and the
tensors it reads live until the kernels reading it run: a gradient sum placed before a
recomputation is computed after it, with both summands alive across the recomputed
tensor's allocation. `inlined` names those ops; the solvers plan the backward with them
read through (`schedule.read_through`), and a plan is priced with every op Inductor
inlines read through.

Inductor also fuses kernels that are not adjacent, and runs a fused kernel where its
first part ran, with everything its later part reads computed before it. Two copies of a
recomputed op that the plan runs far apart share their small inputs (a norm's saved
statistics), so Inductor would fuse them and hold every recomputed tensor in between at
once; `PlanOrder` refuses those fusions, so the backward keeps the plan's order, and
`compile_in_plan_order` compiles each graph with it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch._inductor.config as inductor_config
from torch._inductor.choices import InductorChoices
from torch._inductor.compile_fx import compile_fx_inner
from torch._inductor.scheduler import BaseSchedulerNode, Scheduler
from torch._inductor.virtualized import V

from optremat.compiler.joint import JointStep
from optremat.core.graph import Graph
from optremat.core.schedule import Schedule, SimResult, kept_for_backward, read_through, simulate, without_recomputing
from optremat.tracing.costs import DeviceProfile, fused_cost

HEAVY = ("exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh")
"""Ops whose result Inductor realizes on CPU when several kernels read it (`should_realize_on_reuse`)."""


def inductor_step(step: JointStep, profile: DeviceProfile) -> JointStep:
    """`step` with the backward's pointwise ops read through where Inductor inlines them
    (`inlined`), so that the solvers plan the backward as Inductor runs it. Which forward
    ops are inlined depends on what the plan saves (`priced` prices those); a forward
    pointwise op costs its arithmetic (`costs.fused_cost`), since Inductor fuses it into
    the kernel that reads it, in the forward and where the backward recomputes it."""
    graph = read_through(step.graph, inlined(step, step.graph, ~step.graph.backward))
    nodes = [step.nodes.get(name) for name in graph.names]
    cost = np.array([fused_cost(node, profile) if node is not None and _pointwise(node) and not graph.backward[v]
                     else graph.cost[v] for v, node in enumerate(nodes)])
    cost.setflags(write=False)
    return replace(step, graph=replace(graph, cost=cost))


def priced(step: JointStep, graph: Graph, schedule: Schedule) -> SimResult:
    """`schedule` of `graph` (the step's Graph, perhaps renumbered) priced as Inductor runs
    it: every op not saved for the backward and inlined by Inductor read through."""
    through = read_through(graph, inlined(step, graph, kept_for_backward(graph, schedule)))
    return simulate(through, without_recomputing(through, schedule, graph.pinned))


def inlined(step: JointStep, graph: Graph, realized: np.ndarray) -> np.ndarray:
    """The nodes of `graph` (the step's Graph, perhaps renumbered) that Inductor computes
    inside their readers' kernels: pointwise ops, neither `realized` (returned by a
    compiled graph: saved for the backward) nor an output, whose readers all take an
    inlined input, unless several kernels read an op that reads many tensors or runs a
    costly function (Inductor's thresholds)."""
    nodes = [step.nodes.get(name) for name in graph.names]
    inline = np.zeros(graph.n, dtype=bool)
    reads: list[int] = []
    for v in range(graph.n):
        reads.append(sum(reads[p] if inline[p] else 1 for p in graph.preds[v].tolist()))
        node = nodes[v]
        if node is None or graph.output[v] or realized[v] or not _pointwise(node):
            continue
        readers = graph.succs[v].tolist()
        shared = len(readers) > 1 and (reads[v] > inductor_config.realize_reads_threshold
                                       or str(node.target).split(".")[1] in HEAVY)
        inline[v] = (bool(readers) and not shared and reads[v] <= _accumulated_reads()
                     and all(_inlines_inputs(graph, nodes, r) for r in readers))
    return inline


def _pointwise(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and torch.Tag.pointwise in getattr(node.target, "tags", ())


def _inlines_inputs(graph: Graph, nodes: list[torch.fx.Node | None], reader: int) -> bool:
    """Whether Inductor computes the inputs of `reader` inside its kernel: a pointwise op
    or a reduction does; a view does when its own readers do."""
    node = nodes[reader]
    if node is None or node.op != "call_function":
        return False
    if graph.alias_of[reader] >= 0 and graph.size[reader] == 0:
        return all(_inlines_inputs(graph, nodes, r) for r in graph.succs[reader].tolist())
    tags = getattr(node.target, "tags", ())
    return torch.Tag.pointwise in tags or torch.Tag.reduction in tags


def _accumulated_reads() -> int:
    return inductor_config.realize_acc_reads_threshold or inductor_config._realize_acc_reads_threshold_default


class PlanOrder(InductorChoices):
    """Inductor's fusion heuristics, less any fusion that would run a kernel before a
    kernel the graph orders between the two fused ones: the later kernel would then be
    computed early, with everything it reads, and the tensors of the plan's order would no
    longer be the ones alive."""

    @staticmethod
    def can_fuse(scheduler: Scheduler, node1: BaseSchedulerNode, node2: BaseSchedulerNode,
                 shared_data_score: int) -> bool:
        return (InductorChoices.can_fuse(scheduler, node1, node2, shared_data_score)
                and not _pulls_forward(scheduler, node1, node2))

    def uuid(self) -> str:
        return "optremat.PlanOrder"


def _pulls_forward(scheduler: Scheduler, node1: BaseSchedulerNode, node2: BaseSchedulerNode) -> bool:
    """Whether fusing the two nodes moves a kernel that the graph runs between them (an
    ancestor of the later one) before the earlier one."""
    first, second = sorted((node1, node2), key=lambda node: node.min_order)
    for name in second.ancestors:
        ancestor = scheduler.name_to_fused_node.get(name)
        if ancestor is not None and first.max_order < ancestor.min_order and ancestor.max_order < second.min_order:
            return True
    return False


def compile_in_plan_order(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
    """Inductor's `compile_fx_inner` with `PlanOrder` deciding fusions, for this graph only:
    Inductor keeps one choices handler per thread, made from its config the first time it
    is read, so setting the config would not reach a thread that compiled before and would
    reach every graph compiled after."""
    with V.set_choices_handler(PlanOrder()):
        return compile_fx_inner(gm, example_inputs, **kwargs)
