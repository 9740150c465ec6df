"""The exact runtime: execute any schedule op by op, each recomputation where the schedule puts it.

The whole traced step (forward and backward ops) becomes one autograd Function. Its
forward runs the schedule's stages up to the first op that reads the output's gradient
and returns the model's outputs; the tensors the schedule keeps into later stages stay
with the Function. Its backward receives the output's gradient, runs the remaining stages
and hands autograd the parameter gradients. Every tensor is freed exactly where
`simulate()` frees it, so the measured peak follows the simulated one, and a node may be
computed any number of times. Random ops replay the generator state of their first run,
recomputed ops that update buffers (BatchNorm statistics) write to scratch copies, and a
pointwise op the plan shares writes its result over the input it is the last to read.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.fx
from torch.utils._pytree import tree_leaves, tree_unflatten

from optremat.extract import Traced, depending_on, mutated_inputs
from optremat.graph import Graph
from optremat.runtime.ops import (autocast_state, call, is_random, rng_state, set_rng_state,
                                  signature_of)
from optremat.schedule import Schedule, simulate


def exact_program(model: torch.nn.Module, traced: Traced, inputs: tuple, graph: Graph, schedule: Schedule,
                  shared: dict[int, int] | None = None) -> "ExactProgram":
    """The executable for `schedule` on `graph` (`traced`'s step, perhaps reordered) of
    `model` on inputs like `inputs`, the computations in `shared` writing over the input
    it names."""
    return ExactProgram(traced, graph, schedule, len(dict(model.named_parameters())),
                        len(dict(model.named_buffers())), len(tree_leaves(inputs)), shared)


class ExactProgram:
    """A schedule of `graph` (the traced step, in any topological order) ready to run."""

    def __init__(self, traced: Traced, graph: Graph, schedule: Schedule, num_params: int, num_buffers: int,
                 num_inputs: int, shared: dict[int, int] | None = None) -> None:
        gm = traced.module
        by_name = {n.name: n for n in gm.graph.nodes}
        self.nodes = [by_name[name] for name in graph.names]
        index = {node: i for i, node in enumerate(self.nodes)}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        leaves = num_params + num_buffers + num_inputs
        self.inputs = [index[n] for n in placeholders[:leaves]]
        self.buffers = {index[n] for n in placeholders[num_params:num_params + num_buffers]}
        self.tangent_inputs = [index[n] for n in placeholders[leaves:]]
        self.constants = {index[n]: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
        self.signature = signature_of([n.meta.get("val") for n in placeholders[num_params + num_buffers:leaves]])
        self.autocast = autocast_state()
        self.output_spec = traced.output_spec
        self.output_leaves = tuple((True, index[by_name[leaf]]) if isinstance(leaf, str) and leaf in by_name
                                   else (False, leaf) for leaf in traced.output_leaves)
        self.tensor_outputs = [value for produced, value in self.output_leaves if produced]
        self.tangents = traced.tangents
        returned = tree_leaves(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        results = len(returned) - len(self.tensor_outputs)
        self.gradients = dict(zip(traced.gradients, (index[n] for n in returned[results - len(traced.gradients):results])))
        self.fingerprint = traced.graph.fingerprint
        self.index = index
        self.mutated_buffers = [[index[b] for b in mutated_inputs(node) if index[b] in self.buffers] for node in self.nodes]
        self.split = _first_reading(graph, self.tangent_inputs)
        self.stages = _instructions(graph, schedule, shared or {})

    def run(self, param_names: list[str], leaves: list[Any]) -> Any:
        """The model's output for one training step; its backward runs the rest of the schedule."""
        outputs = _Step.apply(self, param_names, *leaves)
        values = iter(outputs)
        return tree_unflatten([next(values) if produced else value for produced, value in self.output_leaves],
                              self.output_spec)

    def forward_part(self, leaves: tuple) -> tuple[dict[int, Any], dict[int, Any]]:
        env: dict[int, Any] = dict(zip(self.inputs, leaves))
        env.update(self.constants)
        rng: dict[int, Any] = {}
        for s in range(self.split):
            self._stage(s, env, rng)
        return env, rng

    def backward_part(self, env: dict[int, Any], rng: dict[int, Any], grads: list[Any]) -> dict[int, Any]:
        env.update(zip(self.tangent_inputs, grads))
        for s in range(self.split, len(self.stages)):
            self._stage(s, env, rng)
        return env

    def _stage(self, s: int, env: dict[int, Any], rng: dict[int, Any]) -> None:
        drop_first, events = self.stages[s]
        for i in drop_first:
            del env[i]
        for k, drops, into in events:
            node = self.nodes[k]
            recompute = k != s
            scope = env
            if recompute and self.mutated_buffers[k]:
                scope = {**env, **{i: env[i].clone() for i in self.mutated_buffers[k]}}
            index = self.index

            def value(fx_node: torch.fx.Node) -> Any:
                return scope[index[fx_node]]

            if into >= 0:
                env[k] = call(node, value, into=env[into])
            elif is_random(node):
                device = tree_leaves(node.meta["val"])[0].device
                if recompute:
                    current = rng_state(device)
                    set_rng_state(device, rng[k])
                    env[k] = call(node, value)
                    set_rng_state(device, current)
                else:
                    rng[k] = rng_state(device)
                    env[k] = call(node, value)
            else:
                env[k] = call(node, value)
            for i in drops:
                del env[i]


class _Step(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, program: ExactProgram, param_names: list[str], *leaves: Any) -> tuple:
        env, rng = program.forward_part(leaves)
        ctx.program, ctx.env, ctx.rng, ctx.param_names = program, env, rng, param_names
        ctx.num_leaves = len(leaves)
        outputs = tuple(env[i] for i in program.tensor_outputs)
        ctx.mark_non_differentiable(*(t for j, t in enumerate(outputs) if j not in program.tangents))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        program = ctx.program
        env, ctx.env = ctx.env, None
        env = program.backward_part(env, ctx.rng, [grads[j] for j in program.tangents])
        by_param = {name: env[i] for name, i in program.gradients.items()}
        param_grads = [by_param.get(name) for name in ctx.param_names]
        return (None, None, *param_grads, *[None] * (ctx.num_leaves - len(param_grads)))


def _first_reading(graph: Graph, tangents: list[int]) -> int:
    """The first node (in the graph's order) that depends on the output's gradient."""
    depends = depending_on(graph, tangents)
    return int(np.argmax(depends)) if depends.any() else graph.n


def _instructions(graph: Graph, schedule: Schedule, shared: dict[int, int]
                  ) -> list[tuple[tuple[int, ...], list[tuple[int, tuple[int, ...], int]]]]:
    """Per stage: the values to delete on entry, then each computation with the values to
    delete right after it and the input it writes over (-1 for none; `shared` maps event
    indices to those inputs), where `simulate()` frees them."""
    result = simulate(graph, schedule, share=frozenset(shared), frees=True)
    bounds = np.searchsorted(schedule.stage, np.arange(graph.n + 1)).tolist()
    return [(on_entry, [(k, drops, shared.get(lo + pos, -1))
                        for pos, (k, drops) in enumerate(zip(schedule.node[lo:].tolist(), after))
                        if not graph.pinned[k]])
            for lo, (on_entry, after) in zip(bounds, result.frees)]
