"""An exact drop-in for the knapsack inside PyTorch's memory-budget partitioner.

With `torch._functorch.config.activation_memory_budget` below 1, the min-cut partitioner
lists the activations it could save or recompute, each with its memory (a fraction of
the activation range) and runtime, and asks a knapsack solver which to save within the
budget. PyTorch's default solver quantizes memory to 1e-4 of that range, so its answer
may exceed the budget or miss the best choice; `KnapsackSolver` solves the same
problem exactly in bytes with CP-SAT: saved bytes never exceed the budget, and the
recompute it leaves is never more than the default solver's, whose answer (when it
fits) seeds the search and is kept if the search finds nothing better in time.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from typing import Any

import torch.fx as fx
from ortools.sat.python import cp_model
from torch._functorch import config as functorch_config
from torch._functorch._activation_checkpointing.knapsack import dp_knapsack
from torch._functorch.partitioners import _size_of
from torch._inductor.custom_graph_pass import CustomKnapsackSolver, CustomRuntimeEstimator

from optremat.tracing.costs import node_flops

RESOLUTION = 10**9
"""Runtimes are scaled to integers of this resolution relative to the largest."""


class KnapsackSolver(CustomKnapsackSolver):
    """`torch._functorch.config.activation_memory_budget_solver = KnapsackSolver()`.

    Runtimes are those of PyTorch's configured estimator
    (`activation_memory_budget_runtime_estimator`: FLOPs by default), the numbers its own
    solvers weigh; `calls` counts the problems solved.
    """

    def __init__(self, time_limit: float = 10.0, workers: int = 0) -> None:
        self.time_limit = time_limit
        self.workers = workers
        self.calls = 0

    def __call__(self, memory: list[float], joint_graph: fx.Graph, max_memory: float, node_info: Any,
                 all_recomputable_banned_nodes: list[fx.Node]) -> tuple[list[int], list[int]]:
        self.calls += 1
        sizes = [_size_of(node) for node in all_recomputable_banned_nodes]
        runtimes = [runtime_estimate(node) for node in all_recomputable_banned_nodes]
        saved = solve_knapsack(sizes, runtimes, _capacity(sizes, memory, max_memory), self.time_limit, self.workers,
                               hint=_fitting_default(memory, runtimes, max_memory))
        return saved, [i for i in range(len(sizes)) if i not in set(saved)]

    def uuid(self) -> str:
        text = inspect.getsource(type(self)) + inspect.getsource(solve_knapsack) + repr((self.time_limit,))
        return hashlib.sha256(text.encode()).hexdigest()


def solve_knapsack(sizes: list[int], runtimes: list[float], capacity: int, time_limit: float = 10.0,
                   workers: int = 0, hint: list[int] | None = None) -> list[int]:
    """The items to save (indices): the most runtime saved with at most `capacity` bytes,
    optimal when CP-SAT proves it within `time_limit`, never worse than `hint`."""
    if not sizes:
        return []
    top = max(max(runtimes), 1e-30)
    value = [round(r / top * RESOLUTION) for r in runtimes]
    model = cp_model.CpModel()
    take = [model.new_bool_var(f"save{i}") for i in range(len(sizes))]
    model.add(sum(s * x for s, x in zip(sizes, take)) <= capacity)
    model.maximize(sum(v * x for v, x in zip(value, take)))
    hinted = set(hint or ())
    for i, x in enumerate(take):
        model.add_hint(x, i in hinted)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = workers
    status = solver.solve(model)
    found = [i for i, x in enumerate(take) if solver.value(x)] if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else []
    if (hint is not None and sum(sizes[i] for i in hint) <= capacity
            and sum(runtimes[i] for i in hint) > sum(runtimes[i] for i in found)):
        return sorted(hint)
    return found


def runtime_estimate(node: fx.Node) -> float:
    """The runtime PyTorch's configured estimator gives `node`, computed from the node's
    fake tensors: the knapsack is called where ops cannot run on them."""
    estimator = functorch_config.activation_memory_budget_runtime_estimator
    if estimator == "flops":
        return float(max(node_flops(node), 1))
    if estimator == "testing":
        return 1.0
    if isinstance(estimator, CustomRuntimeEstimator):
        return float(estimator(node))
    raise ValueError(f"KnapsackSolver weighs runtimes from the 'flops', 'testing' or a custom estimator, "
                     f"not {estimator!r}")


def _capacity(sizes: list[int], memory: list[float], max_memory: float) -> int:
    """The budget in bytes: PyTorch's memories are bytes over one common scale."""
    largest = max(range(len(sizes)), key=lambda i: memory[i], default=None)
    if largest is None or memory[largest] <= 0:
        return 0
    return math.floor(max_memory * sizes[largest] / memory[largest] * (1 + 1e-12))


def _fitting_default(memory: list[float], runtimes: list[float], max_memory: float) -> list[int] | None:
    """PyTorch's default (dp) answer when its saved memory fits the budget, else None."""
    _, saved, _ = dp_knapsack(memory, runtimes, max_memory)
    return saved if sum(memory[i] for i in saved) <= max_memory else None
