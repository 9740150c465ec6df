"""The LM head's chunking chosen with the region plan: a causal LM's head and loss
(`CausalLMLoss(chunks="auto")`, or a transformers causal LM's own, `causal_lm`) run whole
or in k token chunks, each count traced and its region plan solved exactly (unless its
step alone costs more than a plan found already), the cheapest that fits the budget kept.

Every count in `CHOICES` is priced, so where each region search is proven the chosen
plan is optimal over counts and regions together; its overhead and bound are of the
unplanned step with the whole head, as its budget fraction is.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable, Protocol, Sequence, TypeVar

import torch.nn as nn

from optremat.core.budget import InfeasibleBudget
from optremat.core.graph import Graph
from optremat.core.schedule import keep_all, simulate
from optremat.core.solution import FEASIBLE, OPTIMAL
from optremat.planning.native import ROUNDING
from optremat.planning.result import Chunking, Plan
from optremat.tracing.lm_loss import CausalLMLoss

CHOICES = (None, 2, 4, 8, 16, 32, 64, 128)
"""The chunk counts priced (None: whole), those leaving a chunk under `MIN_ROWS` tokens out.
PyTorch's own default for `F.linear_cross_entropy` on a CPU runs 32-token chunks (128 on
gpt-small's 4096 tokens, 64 on gpt-mini's 1024), so the counts reach that far."""

MIN_ROWS = 16
"""The fewest tokens a chunk is priced with: below that the head's matmuls run at a small
fraction of their speed for little less memory."""


def head_name(model: nn.Module, loss_fn: CausalLMLoss) -> str:
    """The name `named_parameters` gives the head's weight; a ValueError if the head is
    not the model's, as its gradient would then not be planned."""
    weight = loss_fn.weights(substituted=False)[0]
    name = next((name for name, p in model.named_parameters() if p is weight), None)
    if name is None:
        raise ValueError(f"CausalLMLoss's head is not a parameter of {type(model).__name__}: pass the model's own "
                         "head (its nn.Linear, the embedding it is tied to, or that weight) so that its gradient is "
                         "planned with the step")
    return name


def choices(tokens: int) -> tuple[int | None, ...]:
    """The chunk counts priced for a loss over `tokens` positions."""
    return tuple(k for k in CHOICES if k is None or k * MIN_ROWS <= tokens)


class Step(Protocol):
    """A step planned with one chunk count: a region map (`RegionMap`) or a compiled
    joint graph (`compiler.joint.JointStep`), each holding its Graph."""

    graph: Graph


S = TypeVar("S", bound=Step)


def solve_chunked(whole: S, map_for: Callable[[int], S], tried: Sequence[int | None], head: str,
                  budget_bytes: int, solve: Callable[[S, float], Plan], time_limit: float,
                  report: Callable[[float, float], None] | None = None, deterministic: bool = False,
                  bound_of: Callable[[S], float | None] | None = None) -> Plan:
    """The cheapest plan that fits over every count in `tried`: `whole` is the step with
    the whole head, `map_for(k)` the one in k chunks, `solve(step, time_limit)` the
    plan for one. Counts are solved from the cheapest step up, each given an equal share
    of the seconds left (a search ending early leaves its time to the next, one running
    over takes it from them), or with `deterministic` an equal share of `time_limit` (a
    deterministic time). Once a plan is found, a count is first bounded without a search:
    by its step's own cost, or where larger by `bound_of(step)` (an overhead found without
    searching, None where none is known: on a chain of alike blocks, what the blocks'
    composition bounds plans of regions inside them by). It is not searched where no time
    is left for it or that bound is above the plan (on a Llama-7B at half its peak, four
    of seven counts). A searched count's bound is its search's (for a count refused
    unproven, the finite bound its composition put on plans of regions inside the
    blocks), or where that search proved none, the bound without a search; bounds from a
    composition cover plans of regions inside the blocks, the scope composed plans'
    bounds have. Ties go to fewer chunks. OPTIMAL when the plan meets the least bound of all
    counts (a count no plan fits counts only when its search proved it).
    `report(overhead, bound)`, if given, is called after each count is solved, once a
    plan fits, with the cheapest plan so far and the least bound over every count, both
    of the whole head's step. InfeasibleBudget when no count fits, naming the least peak
    found over all."""
    total = whole.graph.total_cost
    maps = {k: whole if k is None else map_for(k) for k in tried}
    scale = {k: maps[k].graph.total_cost / total for k in tried}
    found: dict[int | None, tuple[Plan | None, float, float]] = {}
    refusals: list[InfeasibleBudget] = []
    deadline = time.perf_counter() + time_limit
    order = sorted(tried, key=lambda k: scale[k])
    for i, k in enumerate(order):
        cheapest = min((f[1] for f in found.values()), default=math.inf)
        share = time_limit / len(tried) if deterministic else (deadline - time.perf_counter()) / (len(order) - i)
        unsearched = scale[k] - 1  # no plan of the step costs less than the step
        if math.isfinite(cheapest) and unsearched <= cheapest + ROUNDING and bound_of is not None:
            known = bound_of(maps[k])
            unsearched = unsearched if known is None else max(scale[k] * (1 + known) - 1, unsearched)
        if math.isfinite(cheapest) and (share <= 0 or unsearched > cheapest + ROUNDING):
            found[k] = (None, math.inf, unsearched)
            continue
        try:
            plan = solve(maps[k], max(share, time_limit / len(tried) / 4))
        except InfeasibleBudget as error:
            refusals.append(error)
            scoped = error.bound is not None and math.isfinite(error.bound)
            found[k] = (None, math.inf, math.inf if error.impossible else
                        max(scale[k] * (1 + error.bound) - 1, unsearched) if scoped else unsearched)
        else:
            proven = unsearched if plan.lower_bound is None else (1 + plan.lower_bound) * scale[k] - 1
            found[k] = (plan, (1 + plan.predicted_overhead) * scale[k] - 1, proven)
        best = min(f[1] for f in found.values())
        if report is not None and math.isfinite(best):
            report(best, min(found[j][2] if j in found else scale[j] - 1 for j in tried))
    fitting = [(k, *found[k]) for k in tried if found[k][0] is not None]
    if not fitting:
        smallest = min(refusals, key=lambda e: e.smallest)
        floors = [e.floor for e in refusals]
        raise InfeasibleBudget(budget_bytes, smallest.smallest, f"{refusals[0].planner} with the LM head chunked",
                               proven=all(e.proven for e in refusals),
                               scope=" for plans of module regions and LM head chunks",
                               floor=None if None in floors else min(floors), note=refusals[0].note)
    least = min(f[2] for f in fitting)
    k, plan, overhead, _ = next(f for f in fitting if f[2] <= least + ROUNDING)  # `tried` lists fewer chunks first
    bound = min(f[2] for f in found.values())
    return replace(plan, baseline_peak_bytes=simulate(whole.graph, keep_all(whole.graph)).peak_bytes,
                   predicted_overhead=overhead, lower_bound=bound,
                   status=OPTIMAL if overhead <= bound + ROUNDING else FEASIBLE,
                   solver_overhead=(1 + plan.solver_overhead) * scale[k] - 1,
                   chunking=Chunking(head, k, simulate(plan.graph, keep_all(plan.graph)).peak_bytes, tuple(tried)))
