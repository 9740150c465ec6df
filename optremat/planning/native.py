"""Plans for the native runtime, which checkpoints module calls of the user's model.

The traced step is seen as module calls (`region_map`); region plans built for the budget
seed an exact search over the runtime's own decisions (`solve_native`), every candidate
priced on every op as the runtime runs it. Given regions are priced the same way at any
input shape (`price_regions`, `reprice`).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import replace
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn as nn

from optremat.core.budget import InfeasibleBudget
from optremat.core.coarsen import coarsen
from optremat.core.schedule import keep_all, kept_for_backward, peak_floor, simulate
from optremat.core.sharding import FSDP, Parallel, per_rank, unit_of
from optremat.core.solution import FEASIBLE, HEURISTIC, OPTIMAL, Progress, Solution
from optremat.ilp.bounds import solver_floor
from optremat.ilp.composed import Composed, FrontierMemo, chain_bound, solve_chain
from optremat.ilp.region_cpsat import least_peak, solve_regions
from optremat.ilp.search import LEAST_SECONDS
from optremat.planners.chain import Chain, chain_of
from optremat.planners.regions import (Priced, Region, RegionMap, kept_of, never_rerun_because, parse_span, price,
                                       search, whole_calls)
from optremat.planners.solve import solve
from optremat.planning.result import Chunking, Plan, loss_note
from optremat.tracing.causal_lm import own_chunks, own_head, running
from optremat.tracing.costs import device_profile, model_device
from optremat.tracing.extract import DefaultLoss, Traced, trace
from optremat.tracing.fingerprint import model_fingerprint
from optremat.tracing.leaks import swept
from optremat.tracing.lm_loss import AUTO, CausalLMLoss

COMPOSED_BLOCKS = 16
"""Blocks from which a budget that neither the composed plan nor any seed fits is refused
without the search over every region set (it proves nothing in minutes at 32 Llama-7B
blocks)."""
SEEDED_BLOCKS = 8
"""Blocks from which a chain is composed at all: a shorter chain's search over every region
set proves its plans in seconds by itself, while composing its blocks (hundreds of small
solves) took 26 of the 69 s a 4-layer Llama's three plans took in the Trainer example. A
composed plan within COMPOSED_GAP of its bound is the plan; otherwise it seeds that search
(on the 8-layer Llama-7B shape, in 10 s, the search's own bounds were 7 to 13 points under
the composition's)."""
COMPOSED_GAP = 0.01
"""How far above its bound (in the step's cost) a composed plan may be and stand."""
ROUNDING = 1e-6
"""Overhead by which a plan may exceed its bound and still be proven optimal: the exact
search rounds each op's cost down to a 1e-10 part of the step's."""


def solve_native(rmap: RegionMap, budget_bytes: int, *, solver: str, time_limit: float,
                  workers: int, seed: int, deterministic: bool, progress: Progress | None,
                  started: float, memo: FrontierMemo | None = None) -> Plan:
    """The cheapest region plan that fits: region plans built for the budget (and, when
    `solver` names one, its keep set solved on the coarsened graph and lowered to module
    regions) seed an exact search over every set of non-overlapping candidate regions
    (`solve_regions`), every plan priced on every op as the runtime runs it. The plan's
    bound is the least cost that search proves; where the time runs out first, the
    memory bound of the step's own graph stands in. OPTIMAL when the plan meets it. A
    chain of identical blocks is first solved once per block and composed (`_composed`):
    that plan, within COMPOSED_GAP of its bound, is the plan; otherwise it is one more seed,
    and when it or any plan of regions inside the blocks wins, the better of its bound and
    the search's is the plan's. A budget
    none of those fits runs the least-peak search, whose plan is the plan where it fits
    (the search under the budget can miss it in its time), else the error names its peak.
    A budget under the step's `peak_floor` is refused without searching for a plan that
    fits, naming the least peak found in the time; so is one that neither the composition of a
    chain of COMPOSED_BLOCKS blocks nor any seed fits (at that size the search over every
    region set finds nothing in minutes). `memo` keeps the chain's block frontiers for the
    next step solved with the same blocks (the same step with its head in other chunks)."""
    graph = rmap.graph
    total = graph.total_cost
    composing = time.perf_counter()
    floor = peak_floor(graph)
    chain = chain_of(rmap)
    long = chain is not None and len(chain.blocks) >= COMPOSED_BLOCKS
    if budget_bytes < floor:
        raise _under_floor(rmap, budget_bytes, floor, long, solver, _left(time_limit, composing, deterministic),
                           workers, seed, deterministic)
    composed = _composed(chain, budget_bytes, time_limit, workers, seed, deterministic, memo)
    if composed is not None and composed.stands:
        if progress is not None:
            progress(time.perf_counter() - started, composed.result.priced.cost, composed.result.bound)
        return _plan_of(rmap, composed.result.priced, budget_bytes, composed.name, composed.result.bound, started)
    kept, coarse_solution = _coarse_kept(rmap, budget_bytes, solver, _left(time_limit, composing, deterministic),
                                         workers, seed, deterministic)
    have = [composed.result.priced] if composed is not None and composed.result.priced is not None else []
    candidates = search(rmap, budget_bytes, kept, math.inf if deterministic else composing + time_limit, have) + have
    fitting = [c for c in candidates if c.result.peak_bytes <= budget_bytes]
    if not fitting and candidates and composed is not None and long:
        raise _refused(rmap, candidates, budget_bytes, solver, floor, composed.result.bound)
    hint = min(fitting, key=lambda c: c.cost).lowering.regions if fitting else ()
    if progress is not None and fitting:
        progress(time.perf_counter() - started, min(c.cost for c in fitting), total)
    searching = _left(time_limit, composing, deterministic)
    exact = solve_regions(rmap, rmap.candidates(), budget_bytes, searching, workers=workers, seed=seed,
                          deterministic=deterministic, hint=hint)
    candidates += [exact.priced] if exact.priced is not None else []
    fitting = [c for c in candidates if c.result.peak_bytes <= budget_bytes]
    if not fitting:  # the least-peak search may find a plan the search under the budget missed in its time
        least, proven = least_peak(rmap, rmap.candidates(), _left(time_limit, composing, deterministic),
                                   workers=workers, seed=seed, deterministic=deterministic)
        if least.result.peak_bytes > budget_bytes:
            raise _infeasible(rmap, budget_bytes, candidates, least, proven, solver, floor)
        fitting = [least]
    bound = (exact.bound if exact.bound is not None and math.isfinite(exact.bound)
             else total + solver_floor(graph, budget_bytes, searching, share=False))
    best: Priced = min(fitting, key=lambda c: c.cost)
    scoped = (composed is not None and _inside(chain, best) and not exact.optimal
              and math.isfinite(composed.result.bound) and composed.result.bound <= best.cost * (1 + 1e-9)
              and (exact.bound is None or composed.result.bound > exact.bound))
    if scoped:
        bound = composed.result.bound
    if progress is not None:
        progress(time.perf_counter() - started, best.cost, bound)
    coarse = best.source == "solver"
    name = composed.name if scoped else coarse_solution.solver if coarse else best.source
    return _plan_of(rmap, best, budget_bytes, name, bound, started,
                    coarse_solution.cost / total - 1 if coarse else best.overhead)


def composed_bound(rmap: RegionMap, budget_bytes: int, *, time_limit: float, workers: int, seed: int,
                   deterministic: bool, memo: FrontierMemo | None = None) -> float | None:
    """A bound on the overhead of plans of `rmap`'s step under `budget_bytes`, with no
    search for a plan: inf under the step's `peak_floor` (no plan fits), else where the
    step has a chain of SEEDED_BLOCKS blocks the bound its composition puts on plans of
    regions inside them, and only those (`chain_bound`: with their frontiers in `memo`,
    one simulation); None where neither says anything."""
    if budget_bytes < peak_floor(rmap.graph):
        return math.inf
    chain = chain_of(rmap)
    if chain is None or len(chain.blocks) < SEEDED_BLOCKS:
        return None
    bound = chain_bound(chain, budget_bytes, time_limit, workers=workers, seed=seed, deterministic=deterministic,
                        memo=memo)
    return bound / rmap.graph.total_cost - 1 if math.isfinite(bound) else None


def _inside(chain: Chain, best: Priced) -> bool:
    """Whether every region of `best` lies inside the chain's blocks (whichever seed found
    it), where the composition's bound holds."""
    inner = {call for calls in chain.inner for call in calls}
    return all((region.path, region.call) in inner for region in best.lowering.regions)


def _left(time_limit: float, since: float, deterministic: bool) -> float:
    """What is left of `time_limit` (wall-clock seconds) `since`, at least LEAST_SECONDS; a
    deterministic limit is work, not time, and stays as it is."""
    return time_limit if deterministic else max(time_limit - (time.perf_counter() - since), LEAST_SECONDS)


class _Chained(NamedTuple):
    """A chain's composed plan and bound, whether that plan stands as the plan, and the
    solver's name for it (with the bound's scope)."""

    result: Composed
    stands: bool
    name: str


def _composed(chain: Chain | None, budget_bytes: int, time_limit: float, workers: int, seed: int,
              deterministic: bool, memo: FrontierMemo | None) -> _Chained | None:
    """The step's chain of identical blocks solved once per block and composed
    (`solve_chain`), None when the step has no such chain of SEEDED_BLOCKS blocks. The
    plan stands within COMPOSED_GAP of its bound; otherwise it competes in the search over
    every region set, and when it wins there and that search proves a weaker bound, its own
    bound (over plans of regions inside the blocks) is the plan's."""
    if chain is None or len(chain.blocks) < SEEDED_BLOCKS:
        return None
    composed = solve_chain(chain, budget_bytes, time_limit, workers=workers, seed=seed, deterministic=deterministic,
                           memo=memo)
    if composed is None:
        return None
    name = (f"composed ({len(chain.blocks)} blocks like {chain.blocks[0][0]!r}; bound over plans of regions "
            "inside them)")
    stands = composed.priced is not None and composed.priced.cost <= composed.bound * (1 + COMPOSED_GAP)
    return _Chained(composed, stands, name)


def _plan_of(rmap: RegionMap, best: Priced, budget_bytes: int, solver: str, bound: float, started: float,
             solver_overhead: float | None = None) -> Plan:
    """The plan of `best`, OPTIMAL when it meets `bound` (seconds; none when not finite);
    `solver_overhead` is what the solver predicted, when it planned another graph."""
    graph = rmap.graph
    lower_bound = bound / graph.total_cost - 1 if math.isfinite(bound) else None
    return Plan(graph=graph, schedule=best.lowering.schedule, regions=best.lowering.regions, model_fingerprint="",
                budget_bytes=budget_bytes, predicted_peak_bytes=best.result.peak_bytes,
                baseline_peak_bytes=simulate(graph, keep_all(graph)).peak_bytes,
                predicted_overhead=best.overhead, solver=solver,
                status=OPTIMAL if lower_bound is not None and best.overhead <= lower_bound + ROUNDING else FEASIBLE,
                lower_bound=lower_bound, solve_seconds=time.perf_counter() - started,
                solver_overhead=best.overhead if solver_overhead is None else solver_overhead)


def _infeasible(rmap: RegionMap, budget_bytes: int, candidates: list[Priced], least: Priced, proven: bool,
                solver: str, floor: int) -> InfeasibleBudget:
    """The error for a budget no region plan fits, naming the least peak of any region
    plan: of `candidates` and `least`, the least-peak search's plan (proven when that
    search ended, or when it meets `floor`)."""
    smallest = min([c.result.peak_bytes for c in candidates] + [least.result.peak_bytes])
    return InfeasibleBudget(budget_bytes, smallest, f"{solver} on the native runtime",
                            proven=(proven and smallest == least.result.peak_bytes) or smallest == floor,
                            scope=" for plans of module regions", floor=floor, note=_never_checkpointed(rmap))


def _never_checkpointed(rmap: RegionMap) -> str:
    """The module calls no plan checkpoints, named for a refusal (empty when none is):
    those the trace ruled out, then those whose rerun would write or read in place
    (`never_rerun_because`), with the first one's reason."""
    notes = []
    calls = sorted(rmap.not_rerun)
    if calls:
        notes.append(f"no plan checkpoints {_named(calls)}: each is handed a key/value cache, draws from a generator "
                     "checkpoint does not restore, or changes its module's Python state or a tensor attribute, "
                     "which a rerun would do again, or reads a tensor's value as a number, or Python state the step "
                     "changes after it, or runs a torch.autograd.Function keeping tensors on its ctx (not "
                     "save_for_backward), which checkpoint cannot drop")
    if rmap.bracketed_calls:
        notes.append(f"no plan checkpoints {_named(rmap.bracketed_calls)}: a module named with brackets (an "
                     "nn.ModuleDict key such as 'layer[1]'), which plans keep for runs of a Sequential's children; "
                     "rename it to checkpoint it")
    because = {call: never_rerun_because(rmap, call) for call in rmap.members
               if parse_span(call[0]) is None and call not in rmap.not_rerun and call not in rmap.bracketed_calls}
    ruled = sorted(call for call, reason in because.items() if reason is not None)
    if ruled:
        path, k = ruled[0]
        notes.append(f"no plan checkpoints {_named(ruled)}: {path or 'the model'} (call {k}) {because[ruled[0]]}")
    return "; ".join(notes)


def _named(calls: list[tuple[str, int]]) -> str:
    named = ", ".join(f"{path or 'the model'} (call {k})" for path, k in calls[:3])
    return named + (f" and {len(calls) - 3} more" if len(calls) > 3 else "")


def _under_floor(rmap: RegionMap, budget_bytes: int, floor: int, long: bool, solver: str, time_limit: float,
                 workers: int, seed: int, deterministic: bool) -> InfeasibleBudget:
    """The error for a budget under the step's floor: the least peak of every call of a
    structure checkpointed whole, and on a step without a `long` chain (COMPOSED_BLOCKS
    blocks) the least peak the exact search finds (on a 70B model's step its model alone
    takes longer to build than a usual time limit)."""
    seeds = whole_calls(rmap)
    if not seeds or not long:
        least, proven = least_peak(rmap, rmap.candidates(), time_limit, workers=workers, seed=seed,
                                   deterministic=deterministic)
        return _infeasible(rmap, budget_bytes, seeds, least, proven, solver, floor)
    return _refused(rmap, seeds, budget_bytes, solver, floor)


def _refused(rmap: RegionMap, seeds: list[Priced], budget_bytes: int, solver: str, floor: int,
             composed: float = -math.inf) -> InfeasibleBudget:
    """The error naming the least peak of `seeds` (proven least when it meets `floor`),
    with the composition's bound (seconds; -inf where none was solved) on plans of regions
    inside the blocks."""
    smallest = min(c.result.peak_bytes for c in seeds)
    bound = composed / rmap.graph.total_cost - 1 if composed > -math.inf else None
    return InfeasibleBudget(budget_bytes, smallest, f"{solver} on the native runtime", proven=smallest == floor,
                            scope=" for plans of module regions", floor=floor, note=_never_checkpointed(rmap),
                            bound=bound)


def _coarse_kept(rmap: RegionMap, budget_bytes: int, solver: str, time_limit: float, workers: int, seed: int,
                 deterministic: bool) -> tuple[np.ndarray | None, Solution | None]:
    """The keep set `solver` finds on the coarsened graph (None for "auto", which leaves
    the plan to the exact region search, or when the solver finds none) and its solution."""
    if solver == "auto":
        return None, None
    graph = rmap.graph
    coarse = coarsen(graph)
    try:
        solution = solve(coarse.coarse, budget_bytes, solver, time_limit=time_limit, workers=workers, seed=seed,
                         deterministic=deterministic)
    except (InfeasibleBudget, TimeoutError):
        return None, None
    kept = np.zeros(graph.n, dtype=bool)
    kept[coarse.original[kept_for_backward(coarse.fine, coarse.expand(solution.schedule))]] = True
    return kept, solution


def region_map(traced: Traced, model: nn.Module, device: str, parallel: Parallel | None = None) -> RegionMap:
    """The traced step (as one rank holds it, under `parallel`) seen as module calls;
    under FSDP no region spans two of its units, and no run of a Sequential's children
    is a region where one child is scripted (its calls are its caller's, and a scripted
    module's first runs profile another graph than a rerun runs)."""
    graph = traced.graph if parallel is None else per_rank(traced.graph, traced.parameters(model), parallel)
    sequences = {path: tuple(f"{path}.{name}" if path else name for name in module._modules)
                 for path, module in model.named_modules()
                 if runs_its_children(module) and not any(isinstance(child, torch.jit.ScriptModule)
                                                          for child in module.children())}
    unit = unit_of(graph, parallel.units, parallel.groups) if isinstance(parallel, FSDP) else None
    profile = device_profile(device)
    buffers = [name for name, _ in model.named_buffers()]
    first = len(dict(model.named_parameters()))
    node = {name: first + buffers.index(name) for name in traced.mutated_buffers if name in buffers}
    # a buffer of a module shared by several calls under each of its names: every call's
    # module holds it, and the runtime copies it for each (found by identity)
    of = {id(buffer): node[name] for name, buffer in model.named_buffers() if name in node}
    written = {alias: of[id(buffer)] for alias, buffer in model.named_buffers(remove_duplicate=False)
               if id(buffer) in of}
    return RegionMap(graph, traced.calls, np.array(traced.random, dtype=bool), traced.grad_of, sequences,
                     profile.dispatch_seconds, unit, profile.rerun_seconds, profile.pack_seconds,
                     profile.rng_state_bytes, written,
                     traced.cached_calls | traced.generator_calls | traced.stateful_calls)


def runs_its_children(module: nn.Module) -> bool:
    """Whether `module` is an nn.Sequential that runs nn.Sequential's own forward, so that
    a run of its children computes exactly what the module computes over them (a
    subclass with its own forward, a residual stack say, computes more, and a forward
    another library wrapped around it does more). An installed plan's forward stands for
    the one it replaced."""
    forward = getattr(module.forward, "replaced", module.forward)
    return isinstance(module, nn.Sequential) and getattr(forward, "__func__", None) is nn.Sequential.forward


@swept
def price_regions(model: nn.Module, example_inputs: Sequence[Any] | Any, regions: Sequence[Region], *,
                  loss_fn: Callable[[Any], torch.Tensor] | None = None, cost_model: str = "roofline",
                  device: str | None = None, parallel: Parallel | None = None,
                  head_chunks: int | None = None) -> Plan:
    """The native plan that checkpoints exactly `regions`, priced as `plan` prices its own
    (its budget is its peak): per-block checkpointing is one Region per block call saving
    nothing, so other planners' choices are compared on the same simulator. `head_chunks`,
    a count, runs a transformers causal LM's own head and loss in that many token chunks,
    as `plan(..., head_chunks=...)` does."""
    if head_chunks == AUTO:
        raise ValueError('price_regions prices the decisions given: head_chunks None (whole) or a count, not "auto"')
    own = own_head(model, example_inputs, loss_fn, head_chunks)
    chunks = None if own is None else head_chunks
    device_name = device or model_device(model)
    default = DefaultLoss()
    with running(model, chunks, None if own is None else own[0]):
        traced = trace(model, example_inputs, loss_fn or default, cost_model=cost_model, device=device_name)
    rmap = region_map(traced, model, device_name, parallel)
    missing = [f"{r.path} (call {r.call})" for r in regions if (r.path, r.call) not in rmap.members]
    if missing:
        raise ValueError(f"no module call {', '.join(missing)} in {type(model).__name__}'s step")
    handed = [f"{r.path} (call {r.call})" for r in regions if (r.path, r.call) in traced.cached_calls]
    if handed:
        raise ValueError(f"{', '.join(handed)} is handed a key/value cache, which a checkpointed rerun would write "
                         "again: leave it out, or set use_cache=False")
    drawing = [f"{r.path} (call {r.call})" for r in regions if (r.path, r.call) in traced.generator_calls]
    if drawing:
        raise ValueError(f"{', '.join(drawing)} draws random numbers from a generator checkpoint does not restore "
                         "for the rerun (its own torch.Generator, numpy's or Python's random): leave it out")
    stateful = [f"{r.path} (call {r.call})" for r in regions if (r.path, r.call) in traced.stateful_calls]
    if stateful:
        raise ValueError(f"{', '.join(stateful)} changes its module's Python state (an attribute it sets or counts), "
                         "which a rerun would change again, or finds it changed when the model's forward returns, "
                         "so that a rerun would read another value: leave it out")
    started = time.perf_counter()
    priced = price(rmap, *kept_of(rmap, regions), "given")
    lowered = {(g.path, g.call) for g in priced.lowering.regions}
    dropped = [f"{r.path} (call {r.call})" for r in regions if (r.path, r.call) not in lowered]
    if dropped:
        warnings.warn(f"optremat: {', '.join(dropped)} runs unplanned: checkpoint cannot rerun it as it ran (its "
                      "autograd nodes save nothing, it writes a tensor from outside it in place, or a tensor it "
                      "reads is written in place after it); priced so", stacklevel=2)
    graph = rmap.graph
    baseline = simulate(graph, keep_all(graph)).peak_bytes
    return Plan(graph=graph, schedule=priced.lowering.schedule, regions=priced.lowering.regions,
                model_fingerprint=model_fingerprint(model), budget_bytes=priced.result.peak_bytes,
                predicted_peak_bytes=priced.result.peak_bytes, baseline_peak_bytes=baseline,
                predicted_overhead=priced.overhead, solver="given", status=HEURISTIC, lower_bound=None,
                solve_seconds=time.perf_counter() - started, solver_overhead=priced.overhead,
                training=model.training, mutated_buffers=traced.mutated_buffers,
                loss=loss_note(loss_fn, default.source, chunks),
                chunking=None if own is None else Chunking(own[0], chunks, baseline, (chunks,)),
                parallel=parallel, cost_model=cost_model, device=str(device_name))


def reprice(plan: Plan, model: nn.Module, example_inputs: Sequence[Any] | Any,
            loss_fn: Callable[[Any], torch.Tensor] | None = None) -> Plan:
    """A native plan's regions priced at other inputs' shapes: the same decisions, with
    the peak and overhead they have there (the budget becomes that peak); a
    `CausalLMLoss(chunks="auto")`, or a transformers causal LM's own head and loss, runs
    in the plan's chunks, as it does once applied."""
    if plan.runtime != "native":
        raise ValueError(f"only native plans run at other shapes; this one is {plan.runtime!r}")
    chunks = None if plan.chunking is None else plan.chunking.chunks
    if plan.chunking is not None and isinstance(loss_fn, CausalLMLoss) and loss_fn.chunks == AUTO:
        loss_fn = loss_fn.with_chunks(chunks)
    priced = price_regions(model, example_inputs, plan.regions, loss_fn=loss_fn, parallel=plan.parallel,
                           cost_model=plan.cost_model, device=plan.device,
                           head_chunks=None if loss_fn is not None else own_chunks(model, chunks, None if plan.chunking is None else plan.chunking.head))
    return replace(plan, graph=priced.graph, schedule=priced.schedule, budget_bytes=priced.budget_bytes,
                   predicted_peak_bytes=priced.predicted_peak_bytes, baseline_peak_bytes=priced.baseline_peak_bytes,
                   predicted_overhead=priced.predicted_overhead, solver_overhead=priced.solver_overhead,
                   loss=priced.loss, cached=False)
