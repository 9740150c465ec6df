"""What a trace of one training step gives: the fx graph traced, the Graph built from
it, and per node what the native runtime's plans need (the module calls around it, the
autograd node that ran it, whether it draws random numbers)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch.fx
import torch.nn as nn

from optremat.core.graph import Graph


@dataclass(frozen=True)
class Traced:
    """A traced training step: the fx graph traced (for a model of many alike blocks,
    the step through four of them, `tracing.repeat`; for an LM head's chunk loop, the
    loop through five chunks, `tracing.chunk_copies`) and the Graph of the whole step.

    `grad_of` gives, per Graph node, the forward node whose autograd node ran it in the backward
    (-1 for forward nodes and for backward ops autograd runs between nodes, such as the
    sums of gradients); a saved tensor is saved by that autograd node. `gradients`
    names the parameters whose gradients the step returns, in order, and `gradient_nodes`
    the Graph nodes holding them. `cached_calls` are the module calls handed a key/value
    cache (`tracing.kv_cache`) and `generator_calls` those drawing random numbers from a
    generator checkpoint does not restore for a rerun (a `torch.Generator` of their own,
    numpy's or Python's `random`): neither is ever checkpointed, nor are the calls
    in `stateful_calls`, which change their module's Python state (a counter, a cache
    set on first use), as a rerun would change it again.
    """

    module: torch.fx.GraphModule
    graph: Graph
    grad_of: np.ndarray
    gradients: tuple[str, ...] = ()
    calls: tuple[tuple[tuple[str, int], ...], ...] = ()
    random: tuple[bool, ...] = ()
    mutated_buffers: tuple[str, ...] = ()
    gradient_nodes: tuple[int, ...] = ()
    cached_calls: frozenset[tuple[str, int]] = frozenset()
    generator_calls: frozenset[tuple[str, int]] = frozenset()
    stateful_calls: frozenset[tuple[str, int]] = frozenset()

    def parameters(self, model: nn.Module) -> list[tuple[int, int]]:
        """(parameter node, node holding its gradient or -1) for each of `model`'s
        parameters: the placeholders come first, in `named_parameters` order."""
        grads = dict(zip(self.gradients, self.gradient_nodes))
        return [(k, grads.get(name, -1)) for k, name in enumerate(dict(model.named_parameters()))]
