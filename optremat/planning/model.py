"""`plan()`: from a model, example inputs and a budget to a Plan a runtime executes.

The runtime runs module calls of the user's model under checkpoint with selective
policies, so plans are region plans, solved exactly in those decisions
(`optremat.planning.native`). Here: checking the request, tracing the step, resolving the
budget and the plan cache.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from optremat.core.budget import ACCEPTED, check_budget, resolve_budget
from optremat.core.graph import format_bytes
from optremat.core.sharding import DDP, FSDP, Parallel, check_matched
from optremat.core.solution import Progress
from optremat.ilp.composed import FrontierMemo
from optremat.ilp.search import LEAST_SECONDS, check_search, check_time_limit
from optremat.planners.solve import SOLVERS
from optremat.planning.cache import PlanCache
from optremat.planning.chunking import choices, head_name, solve_chunked
from optremat.planning.native import composed_bound, region_map, solve_native
from optremat.planning.result import Chunking, Plan, loss_note
from optremat.tracing.causal_lm import own_head, running
from optremat.tracing.costs import DeviceProfile, model_device
from optremat.tracing.extract import DefaultLoss, trace
from optremat.tracing.fingerprint import model_fingerprint, package_version
from optremat.tracing.leaks import swept
from optremat.tracing.lm_loss import AUTO, CausalLMLoss


@swept
def plan(model: nn.Module, example_inputs: Sequence[Any] | Any, budget: int | float | str, *,
         solver: str = "auto", time_limit: float = 30.0, loss_fn: Callable[[Any], torch.Tensor] | None = None,
         cost_model: str = "roofline", device: str | DeviceProfile | None = None, workers: int = 0, seed: int = 0,
         deterministic: bool = False, progress: Progress | None = None, cache: str | Path | None = None,
         parallel: Parallel | None = None, head_chunks: int | str | None = AUTO) -> Plan:
    """Plan one training step of `model` on inputs shaped like `example_inputs` under `budget`.

    `example_inputs` is a batch as the model takes it: a dict is called as
    `model(**batch)`, a tuple or list as `model(*args)`, `optremat.Inputs(*args, **kwargs)`
    as both, anything else as `model(x)`.
    `budget` is bytes, a size such as "6GiB", or a fraction in (0, 1] of the unplanned
    peak; it bounds the step's peak with parameters and gradients included. Raises
    InfeasibleBudget naming the smallest budget found when no plan fits. The plan runs
    module calls of the user's model under checkpoint with selective policies
    (`optremat.apply`); `loss_fn` folds the loss into what is planned; without it the
    model's own loss is planned where its output carries one (`outputs.loss`, as a
    transformers model given `labels` returns it, or `logits, loss` as nanoGPT's given
    `targets`: `inputs.own_loss`), else the loss is priced as a
    cross-entropy over the output's last dimension (`extract.assumed_loss`); `summary()`
    says which. `solver` "auto" leaves the plan to
    the exact search over module regions; another of `optremat.SOLVERS` also plans on
    the coarsened graph, its keep set lowered to regions as one more seed. A
    `loss_fn` that is an `optremat.CausalLMLoss` over the model's own head with
    `chunks="auto"` has its head run whole or in token chunks as the plan chooses
    (`optremat.planning.chunking`; `time_limit` shared among the counts priced), and a
    budget fraction is of the unplanned step with the whole head. So has the own loss of
    a transformers causal LM (of a form in `optremat.tracing.causal_lm.TEMPLATES`) given `labels`:
    `head_chunks` "auto" leaves its head to the plan, None keeps the model's own forward
    (the whole logits in its output), a count runs the head in that many token chunks;
    once applied, the training steps of a chunked head return `outputs.logits` as None.
    `device` prices the ops: a built-in profile's name (cpu, a100, h100, h200), a
    `DeviceProfile` (`optremat.measure_profile()` measures this machine's), or None for
    the profile of the device the parameters are on. `progress`,
    if given, is called as the search goes: (seconds, overhead, proven lower bound on
    the overhead).
    `cache`, a directory, keeps plans across runs: a second call for the same model,
    shapes, budget and options loads the plan and runs no solver (the key holds the
    traced graph, which module calls plans may checkpoint and which buffers the step
    writes, so code edited to draw random numbers or write state is planned again). `deterministic=True`
    gives the exact solver `time_limit` of deterministic time instead of seconds, so
    that the same call returns the same plan on any machine load. `parallel` plans one
    rank of an FSDP2 or DDP job (`optremat.FSDP`, `optremat.DDP`); a causal LM's own
    head runs its chunks inside the model's forward, where FSDP2's root unit holds the
    head's weight gathered once for the whole chunk loop.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"plan needs the model as a torch.nn.Module, not {type(model).__name__}")
    _check(solver, parallel, budget, time_limit, workers, seed)
    if isinstance(parallel, FSDP):
        check_matched(type(model).__name__, (path for path, _ in model.named_modules() if path),
                      [*parallel.units, *(pattern for group in parallel.groups for pattern in group)])
    _check_callable(loss_fn=loss_fn, progress=progress)
    if own_checkpointing(model):
        raise ValueError(f"{type(model).__name__} has transformers' own activation checkpointing on, which a plan "
                         "would run inside of, priced as if it were off: turn it off "
                         "(gradient_checkpointing_disable()) and let the plan choose what to checkpoint")
    own = own_head(model, example_inputs, loss_fn, head_chunks)
    if not model.training:
        warnings.warn(f"optremat: {type(model).__name__} is in eval mode (as transformers' from_pretrained returns "
                      "models), so this plans eval-mode steps, and training steps run unplanned; call model.train() "
                      "before planning to plan training", stacklevel=2)
    started = time.perf_counter()
    device_name = device or model_device(model)
    default = DefaultLoss()
    lm = loss_fn if isinstance(loss_fn, CausalLMLoss) else None
    if own is not None:
        (head, tokens), asked = own, head_chunks
    elif lm is not None:
        head, tokens, asked = head_name(model, lm), lm.tokens(), lm.chunks
    else:
        head, tokens, asked = None, 0, None
    chunked = asked == AUTO

    def traced_map(chunks: int | None) -> Any:
        """The step traced with the head whole (None) or in `chunks` token chunks."""
        with running(model, None if own is None else chunks, None if own is None else own[0]):
            traced = trace(model, example_inputs, (loss_fn or default) if lm is None else lm.with_chunks(chunks),
                           cost_model=cost_model, device=device_name)
        return traced, region_map(traced, model, device_name, parallel)

    traced, rmap = traced_map(None if chunked else asked)
    graph = rmap.graph
    budget_bytes = resolve_budget(graph, budget)
    floor = int(graph.size[graph.pinned | graph.output].sum())
    if budget_bytes < floor:
        raise ValueError(f"budget {format_bytes(budget_bytes)} is below the {format_bytes(floor)} of parameters, "
                         f"inputs and gradients that every step holds; {ACCEPTED}, at least that")

    memo = FrontierMemo()  # the blocks' frontiers, solved once for every chunk count's step

    def solve(region_plans: Any, limit: float) -> Plan:
        reported = None if progress is None or chunked else _relative(progress, graph.total_cost)
        return solve_native(region_plans, budget_bytes, solver=solver, time_limit=limit, workers=workers, seed=seed,
                            deterministic=deterministic, started=started, memo=memo, progress=reported)

    def bound_of(region_plans: Any) -> float | None:
        return composed_bound(region_plans, budget_bytes, time_limit=LEAST_SECONDS, workers=workers, seed=seed,
                              deterministic=deterministic, memo=memo)

    def solved() -> Plan:
        report = None if progress is None else lambda cost, bound: progress(time.perf_counter() - started, cost, bound)
        found = (solve(rmap, time_limit) if not chunked else
                 solve_chunked(rmap, lambda k: traced_map(k)[1], choices(tokens), head, budget_bytes, solve,
                               time_limit, report, deterministic, bound_of))
        if own is not None and not chunked:  # the count asked for, recorded for apply() to run
            found = replace(found, chunking=Chunking(head, asked, found.baseline_peak_bytes, (asked,)))
        chunks = None if found.chunking is None else found.chunking.chunks
        return replace(found, model_fingerprint=model_fingerprint(model), training=model.training,
                       mutated_buffers=traced.mutated_buffers, loss=loss_note(loss_fn, default.source, chunks),
                       parallel=parallel, solve_seconds=time.perf_counter() - started,
                       cost_model=cost_model, device=device_name)

    if cache is None:
        return solved()
    store = PlanCache(cache)
    key = store.key(graph=graph.fingerprint, model=model_fingerprint(model), regions=rmap.candidates(),
                    mutated_buffers=traced.mutated_buffers, budget=budget_bytes, solver=solver,
                    seed=seed, deterministic=deterministic, cost_model=cost_model, device=str(device_name),
                    training=model.training, version=package_version(),
                    lm_head=None if head is None else {"head": head, "chunks": asked},
                    parallel=None if parallel is None else parallel.describe())
    with store.locked(key):
        hit = store.get(key, time_limit, Plan.from_json)
        if hit is not None:
            return replace(hit, cached=True)
        result = solved()
        store.put(key, result.to_json(), time_limit)
        return result


def _check(solver: str, parallel: Parallel | None, budget: Any, time_limit: Any, workers: Any, seed: Any
           ) -> None:
    """Refuse a request `plan` cannot serve before tracing anything: the budget's form
    (whether it fits needs the graph), the solver and its options, the parallel job."""
    check_budget(budget)
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    check_time_limit(time_limit)
    check_search(workers, seed)
    if parallel is None:
        return
    if not isinstance(parallel, (FSDP, DDP)):
        raise TypeError(f"parallel must be optremat.FSDP or optremat.DDP, not {type(parallel).__name__}")
    if parallel.world < 1:
        raise ValueError(f"{type(parallel).__name__}(world=...) must name the number of ranks; inside an "
                         "initialized process group, optremat.distributed.plan fills it in")


def own_checkpointing(model: nn.Module) -> bool:
    """Whether transformers' own activation checkpointing is on in `model` or a model it
    wraps (PEFT's, a user's), by its newer name first."""
    for module in model.modules():
        name = next((n for n in ("is_activation_checkpointing", "is_gradient_checkpointing")
                     if hasattr(type(module), n)), None)
        if name is not None and getattr(module, name):
            return True
    return False


def _check_callable(**functions: Any) -> None:
    """Refuse an option that must be None or a function and is neither (`progress=True`
    failed only once the search reported progress)."""
    for name, function in functions.items():
        if function is not None and not callable(function):
            raise TypeError(f"{name} must be None or a function, not {function!r}")


def _relative(progress: Progress, total: float) -> Progress:
    """A solver progress callback (absolute costs) reporting overheads instead."""
    return lambda elapsed, cost, bound: progress(elapsed, cost / total - 1, bound / total - 1)
