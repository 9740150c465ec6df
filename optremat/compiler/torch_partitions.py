"""PyTorch's own partitions of a joint graph, as keep sets that compete with optremat's.

PyTorch's min-cut partitioner with `activation_memory_budget` is what a user of
`torch.compile` runs instead of optremat. Its partition of the very joint graph optremat
is planning, at a range of budget fractions, becomes a candidate plan: the forward ops
its backward graph runs again are recomputed where the backward first needs them (as
that graph, reordered to follow the autograd engine, recomputes them), and every other
tensor is kept until its last reader. optremat prices each candidate as its own
partitioner runs it, so the plan it picks is never one PyTorch's knob beats in that
pricing."""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch._functorch.config as functorch_config
import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._guards import detect_fake_mode

from optremat.core.graph import Graph

RIVALS = "pytorch-min-cut"
"""Names the rival partitions in plan cache keys: plans made without them are not reused."""

FRACTIONS = tuple(round(0.1 * k, 1) for k in range(11))
"""The `activation_memory_budget` fractions whose partitions compete (0 to 1 by 0.1)."""


Rival = Callable[[Graph, float], np.ndarray | None]
"""The keep set of PyTorch's partition at a fraction, over a Graph's nodes by name (None
where PyTorch's partitioner fails)."""


def torch_keep_set(joint: fx.GraphModule, joint_inputs: Sequence[object], kwargs: dict[str, Any], graph: Graph,
                   fraction: float) -> np.ndarray | None:
    """The nodes of `graph` (named as in `joint`) that PyTorch's min-cut partition at
    `activation_memory_budget=fraction` does not recompute in its backward graph (a view
    of a recomputed tensor is recomputed with it, whatever name the backward graph gives
    it). On a graph of thousands of nodes it takes seconds (a 32-layer Llama's: 3 to 8).
    `joint` is not modified. It runs under the joint graph's fake tensor mode, as
    AOTAutograd runs it (a graph with random ops in checkpointed calls has their RNG
    states sampled in it). Should PyTorch's partitioner fail, a warning says so and None
    is returned."""
    copied = fx.GraphModule(joint, copy.deepcopy(joint.graph))
    fake_mode = detect_fake_mode(joint_inputs)
    try:
        with (functorch_config.patch(activation_memory_budget=fraction), warnings.catch_warnings(),
              fake_mode if fake_mode is not None else contextlib.nullcontext()):
            warnings.simplefilter("ignore")
            _, backward = min_cut_rematerialization_partition(copied, joint_inputs, **kwargs)
    except Exception as error:  # noqa: BLE001 - PyTorch's partitioner is a rival, never a requirement
        warnings.warn(f"optremat: PyTorch's min-cut partitioner failed on this graph at "
                      f"activation_memory_budget {fraction:g} ({type(error).__name__}: {error}); "
                      "its partitions at the fractions not yet tried do not compete", stacklevel=2)
        return None
    rerun = {node.name for node in backward.graph.nodes if node.op == "call_function"}
    kept = np.array([graph.backward[i] or name not in rerun for i, name in enumerate(graph.names)])
    for i in np.nonzero((graph.alias_of >= 0) & (graph.size == 0))[0].tolist():
        kept[i] &= kept[graph.alias_of[i]]
    return kept
