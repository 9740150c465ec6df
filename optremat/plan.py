"""`plan()`: from a model, example inputs and a budget to a Plan a runtime executes.

The solvers plan on the coarsened graph. The native runtime (the default) runs module
calls of the user's model under checkpoint with selective policies, so its plans are
region plans: the solver's keep set is lowered to regions and competes with region plans
built for the budget (`optremat.regions.search`), every candidate priced on every op as
the runtime executes it, and the cheapest that fits wins. The exact runtime runs the
solver's schedule op by op as it is.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from optremat.budget import ACCEPTED, InfeasibleBudget, resolve_budget
from optremat.cache import PlanCache
from optremat.coarsen import coarsen
from optremat.costs import device_profile, profile_for
from optremat.extract import Traced, after_output_gradient, assumed_loss, loss_bytes, trace
from optremat.fingerprint import model_fingerprint, package_version
from optremat.graph import Graph, format_bytes
from optremat.ilp.cpsat import Progress
from optremat.ilp.layout import ALIGNMENT, layout
from optremat.order import best_order
from optremat.regions import Priced, Region, RegionMap, kept_of, price, search
from optremat.schedule import Schedule, keep_all, simulate
from optremat.sharding import DDP, FSDP, Parallel, per_rank, unit_of
from optremat.solution import FEASIBLE, HEURISTIC, OPTIMAL
from optremat.solve import SOLVERS, best_heuristic, solve

FORMAT_VERSION = 3
RUNTIMES = ("native", "exact")
EXACT_ATTEMPTS = 3
"""Solves tried for the exact runtime, each with the budget reduced by the last plan's excess."""


@dataclass(frozen=True, eq=False)
class Plan:
    """A plan for one model: what to keep, what to recompute, and its price at one input shape.

    `predicted_peak_bytes` and `predicted_overhead` are the simulated numbers of the
    schedule its `runtime` executes at the shape it was priced for (`graph`); a native
    plan's `regions` are keyed by module call and op occurrence, so it runs at any shape
    (`reprice` prices it at another). `status` is OPTIMAL only when the solver proved its
    plan optimal and running it as regions lost nothing; `lower_bound` is the solver's
    proven lower bound on the overhead, in the planning model (the coarsened graph, each
    op computed at most a few times), or None when nothing is proven. `loss` says how the
    loss computed after the model was priced. An exact plan made in this process carries
    the step it was traced from (`traced`), which its runtime then runs without tracing again.
    A plan for a data-parallel job (`parallel`) is priced for one rank and its budget is per rank.
    """

    graph: Graph
    schedule: Schedule
    regions: tuple[Region, ...]
    model_fingerprint: str
    budget_bytes: int
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    predicted_overhead: float
    solver: str
    status: str
    lower_bound: float | None
    solve_seconds: float
    solver_overhead: float
    training: bool = True
    runtime: str = "native"
    shared: tuple[tuple[int, int], ...] = ()
    mutated_buffers: tuple[str, ...] = ()
    loss: str = ""
    parallel: Parallel | None = None
    cached: bool = field(default=False, compare=False)
    traced: Traced | None = field(default=None, repr=False, compare=False)

    @property
    def fingerprint(self) -> str:
        """The planned graph's fingerprint (ops, tensor types, edges)."""
        return self.graph.fingerprint

    def decisions(self) -> dict[str, str]:
        """For every forward op of the model: keep, recompute, share (a view or in-place
        result that holds another tensor's storage, or an op the exact runtime runs over
        the storage of an input it is the last to read) or free (the backward never reads it)."""
        graph = self.graph
        recomputed = {i for i, s, _ in self.schedule.events if s != i}
        writes_over = {int(self.schedule.node[k]) for k, _ in self.shared}
        read_by_backward = np.zeros(graph.n, dtype=bool)
        src, dst = graph.edges[:, 0], graph.edges[:, 1]
        read_by_backward[src[graph.backward[dst]]] = True
        out = {}
        for i in np.nonzero(~graph.backward & ~graph.pinned)[0].tolist():
            if i in recomputed:
                out[graph.names[i]] = "recompute"
            elif (graph.alias_of[i] >= 0 and not graph.is_part[i]) or i in writes_over:
                out[graph.names[i]] = "share"
            else:
                out[graph.names[i]] = "keep" if read_by_backward[i] else "free"
        return out

    def summary(self) -> str:
        """A few lines: budget, predicted peak and overhead, how the plan was found."""
        counts = {k: 0 for k in ("keep", "recompute", "share", "free")}
        for decision in self.decisions().values():
            counts[decision] += 1
        bound = "" if self.lower_bound is None else f", proven overhead >= {self.lower_bound:.2%}"
        lost = self.predicted_overhead - self.solver_overhead
        lowering = f" ({lost:+.2%} from running it as module regions)" if abs(lost) > 5e-5 else ""
        selective = sum(bool(r.saved) for r in self.regions)
        how = {"native": f"{len(self.regions)} module calls checkpointed, {selective} of them saving chosen ops",
               "exact": f"exact runtime (op by op; {len(self.shared)} ops write over inputs they read last)",
               "compiled": "torch.compile's forward and backward graphs run the schedule op by op"}[self.runtime]
        arena = layout(self.graph, self.schedule, "greedy")
        return "\n".join([
            f"budget {format_bytes(self.budget_bytes)}: predicted peak {format_bytes(self.predicted_peak_bytes)} "
            f"(unplanned {format_bytes(self.baseline_peak_bytes)}, "
            f"{self.predicted_peak_bytes / self.baseline_peak_bytes:.0%})",
            f"predicted overhead {self.predicted_overhead:.2%}{lowering}",
            f"solver {self.solver}: {self.status}{bound}, {self.solve_seconds:.2f} s"
            + (" (loaded from the plan cache)" if self.cached else ""),
            f"forward ops: {counts['keep']} kept, {counts['recompute']} recomputed, {counts['share']} shared, "
            f"{counts['free']} freed early; {how}",
            f"loss: {self.loss}",
            *([f"per rank: {self.parallel.describe()}"] if self.parallel else []),
            f"memory layout: an arena of {format_bytes(arena.arena_bytes)} (greedy by size, {arena.fragmentation:+.1%} "
            f"over the {format_bytes(arena.live_bytes)} live at most, allocations aligned to {ALIGNMENT} bytes)",
        ])

    def explain(self, top: int = 15) -> str:
        """Why each of the `top` largest forward tensors is kept, recomputed or shared."""
        graph = self.graph
        index = {name: i for i, name in enumerate(graph.names)}
        decisions = self.decisions()
        largest = sorted(decisions, key=lambda name: -int(graph.size[index[name]]))[:top]
        reasons = {
            "keep": "the backward reads it and the budget allows keeping it",
            "recompute": "the backward reads it; recomputing it is cheaper than the memory",
            "share": "a view or in-place result: it holds another tensor's storage, no bytes of its own",
            "free": "the backward never reads it: freed after its last forward use",
        }
        lines = []
        for name in largest:
            i = index[name]
            where = graph.module[i] or "(top level)"
            lines.append(f"{decisions[name]:9s} {format_bytes(int(graph.size[i])):>11s}  {graph.ops[i]:32s} "
                         f"{where}: {reasons[decisions[name]]}")
        return "\n".join(lines)

    def reprice(self, model: nn.Module, example_inputs: Sequence[Any] | Any,
                loss_fn: Callable[[Any], torch.Tensor] | None = None) -> "Plan":
        """This native plan's regions priced at other inputs' shapes: the same decisions,
        with the peak and overhead they have there (the budget becomes that peak)."""
        if self.runtime != "native":
            raise ValueError("only native plans run at other shapes; plan the exact runtime again")
        priced = price_regions(model, example_inputs, self.regions, loss_fn=loss_fn, parallel=self.parallel)
        return replace(self, graph=priced.graph, schedule=priced.schedule, budget_bytes=priced.budget_bytes,
                       predicted_peak_bytes=priced.predicted_peak_bytes, baseline_peak_bytes=priced.baseline_peak_bytes,
                       predicted_overhead=priced.predicted_overhead, solver_overhead=priced.solver_overhead,
                       loss=priced.loss, cached=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": "optremat.plan",
            "version": FORMAT_VERSION,
            "graph": self.graph.to_json(),
            "schedule": self.schedule.to_json(),
            "regions": [r.to_json() for r in self.regions],
            "model_fingerprint": self.model_fingerprint,
            "mutated_buffers": list(self.mutated_buffers),
            "loss": self.loss,
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "predicted_overhead": self.predicted_overhead,
            "solver": self.solver,
            "status": self.status,
            "lower_bound": self.lower_bound,
            "solve_seconds": self.solve_seconds,
            "solver_overhead": self.solver_overhead,
            "training": self.training,
            "runtime": self.runtime,
            "shared": [list(pair) for pair in self.shared],
            "parallel": None if self.parallel is None else {"kind": type(self.parallel).__name__,
                                                           **asdict(self.parallel)},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Plan":
        if data.get("format") != "optremat.plan":
            raise ValueError("not an optremat plan (missing format tag)")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"plan format version {data.get('version')} is not supported "
                             f"(this optremat reads {FORMAT_VERSION}); plan again")
        fields = {k: v for k, v in data.items() if k not in ("format", "version", "graph", "schedule", "regions",
                                                             "shared", "mutated_buffers", "parallel")}
        return cls(graph=Graph.from_json(data["graph"]), schedule=Schedule.from_json(data["schedule"]),
                   regions=tuple(Region.from_json(r) for r in data["regions"]),
                   shared=tuple((int(k), int(p)) for k, p in data["shared"]),
                   mutated_buffers=tuple(data["mutated_buffers"]), parallel=_parallel_of(data.get("parallel")),
                   **fields)

    def save(self, path: str | Path) -> None:
        """Write the plan as versioned JSON (atomically: a reader never sees half a plan)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_json()))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_json(json.loads(Path(path).read_text()))


def plan(model: nn.Module, example_inputs: Sequence[Any] | Any, budget: int | float | str, *,
         solver: str = "auto", time_limit: float = 30.0, loss_fn: Callable[[Any], torch.Tensor] | None = None,
         cost_model: str = "roofline", device: str | None = None, workers: int = 0, seed: int = 0,
         deterministic: bool = False, progress: Progress | None = None, cache: str | Path | None = None,
         runtime: str = "native", order: str = "traced", parallel: Parallel | None = None) -> Plan:
    """Plan one training step of `model` on inputs shaped like `example_inputs` under `budget`.

    `budget` is bytes, a size such as "6GiB", or a fraction in (0, 1] of the unplanned
    peak; it bounds the step's peak with parameters and gradients included. Raises
    InfeasibleBudget naming the smallest budget found when no plan fits. `progress`, if
    given, is called as the exact solver improves: (seconds, overhead, proven lower bound
    on the overhead). `cache`, a directory, keeps plans across runs: a second call for the
    same model, shapes, budget and options loads the plan and runs no solver.
    `deterministic=True` gives the exact solver `time_limit` of deterministic time
    instead of seconds, so that the same call returns the same plan on any machine load.

    `runtime` picks what executes the plan, and so what is planned: "native" (module calls
    of the user's model under checkpoint with selective policies; `loss_fn` folds the loss
    into what is planned) or "exact" (the whole traced step op by op, so the solver's
    schedule runs as it is; the loss runs outside it, and `loss_fn` makes the plan leave
    room for the loss's memory). Without `loss_fn`, a native plan prices the loss as a
    cross-entropy over the output's last dimension (`extract.assumed_loss`) and an exact
    plan as holding nothing beyond the output's gradient; `summary()` says which. With the
    exact runtime, `order="best"` also lets the step run its independent ops in another
    order where that lowers the unplanned peak (`optremat.order.best_order`).
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    if order not in ("traced", "best"):
        raise ValueError(f"unknown order {order!r}; choose traced or best")
    if order == "best" and runtime != "exact":
        raise ValueError("only the exact runtime runs ops in another order than traced: use runtime='exact'")
    if parallel is not None:
        if not isinstance(parallel, (FSDP, DDP)):
            raise TypeError(f"parallel must be optremat.FSDP or optremat.DDP, not {type(parallel).__name__}")
        if runtime != "native":
            raise ValueError("data-parallel plans run on the native runtime: FSDP and DDP wrap the model's own modules")
        if parallel.world < 1:
            raise ValueError(f"{type(parallel).__name__}(world=...) must name the number of ranks; inside an "
                             "initialized process group, optremat.distributed.plan fills it in")
    started = time.perf_counter()
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    device_name = device or _model_device(model)
    folded = (loss_fn or assumed_loss) if runtime == "native" else None
    traced = trace(model, inputs, folded, cost_model=cost_model, device=device_name)
    loss = 0 if loss_fn is None or folded else loss_bytes(model, inputs, loss_fn, device=device_name)
    rmap = _region_map(traced, model, device_name, parallel) if runtime == "native" else None
    graph = rmap.graph if rmap is not None else _with_loss(traced.graph, traced, _leaf_count(model, inputs), loss)
    budget_bytes = resolve_budget(graph, budget)
    floor = int(graph.size[graph.pinned | graph.output].sum())
    if budget_bytes < floor:
        raise ValueError(f"budget {format_bytes(budget_bytes)} is below the {format_bytes(floor)} of parameters, "
                         f"inputs and gradients that every step holds; {ACCEPTED}, at least that")
    options = dict(solver=solver, time_limit=time_limit, workers=workers, seed=seed, deterministic=deterministic,
                   started=started,
                   progress=None if progress is None else _relative(progress, graph.total_cost))

    def solved() -> Plan:
        if runtime == "exact":
            found = _solve_exact(model, traced, graph, inputs, budget_bytes, order=order, loss=loss, **options)
        else:
            found = _solve_native(rmap, budget_bytes, **options)
        return replace(found, model_fingerprint=model_fingerprint(model), training=model.training,
                       mutated_buffers=traced.mutated_buffers, loss=_loss_note(loss_fn, runtime), parallel=parallel)

    if cache is None:
        return solved()
    store = PlanCache(cache)
    key = store.key(graph=graph.fingerprint, model=model_fingerprint(model), budget=budget_bytes, solver=solver,
                    seed=seed, deterministic=deterministic, cost_model=cost_model, device=str(device_name), training=model.training,
                    runtime=runtime, order=order, version=package_version(),
                    parallel=None if parallel is None else parallel.describe())
    with store.locked(key):
        hit = store.get(key, time_limit, Plan.from_json)
        if hit is not None:
            return replace(hit, traced=traced if runtime == "exact" else None, cached=True)
        result = solved()
        store.put(key, result.to_json(), time_limit)
        return result


def price_regions(model: nn.Module, example_inputs: Sequence[Any] | Any, regions: Sequence[Region], *,
                  loss_fn: Callable[[Any], torch.Tensor] | None = None, cost_model: str = "roofline",
                  device: str | None = None, parallel: Parallel | None = None) -> Plan:
    """The native plan that checkpoints exactly `regions`, priced as `plan` prices its own
    (its budget is its peak): per-block checkpointing is one Region per block call saving
    nothing, so other planners' choices are compared on the same simulator."""
    device_name = device or _model_device(model)
    traced = trace(model, example_inputs, loss_fn or assumed_loss, cost_model=cost_model, device=device_name)
    rmap = _region_map(traced, model, device_name, parallel)
    missing = [f"{r.path} (call {r.call})" for r in regions if (r.path, r.call) not in rmap.members]
    if missing:
        raise ValueError(f"no module call {', '.join(missing)} in {type(model).__name__}'s step")
    started = time.perf_counter()
    priced = price(rmap, *kept_of(rmap, regions), "given")
    graph = rmap.graph
    return Plan(graph=graph, schedule=priced.lowering.schedule, regions=priced.lowering.regions,
                model_fingerprint=model_fingerprint(model), budget_bytes=priced.result.peak_bytes,
                predicted_peak_bytes=priced.result.peak_bytes,
                baseline_peak_bytes=simulate(graph, keep_all(graph)).peak_bytes,
                predicted_overhead=priced.overhead, solver="given", status=HEURISTIC, lower_bound=None,
                solve_seconds=time.perf_counter() - started, solver_overhead=priced.overhead,
                training=model.training, mutated_buffers=traced.mutated_buffers, loss=_loss_note(loss_fn),
                parallel=parallel)


def _relative(progress: Progress, total: float) -> Progress:
    """A solver progress callback (absolute costs) reporting overheads instead."""
    return lambda elapsed, cost, bound: progress(elapsed, cost / total - 1, bound / total - 1)


def _solve_exact(model: nn.Module, traced: Traced, graph: Graph, inputs: tuple, budget_bytes: int, *, solver: str,
                 order: str, loss: int, **options: Any) -> Plan:
    """`plan_step` for the exact runtime: `graph` is the traced step with room for a loss
    of `loss` bytes computed outside it (`_with_loss`), run in its traced order or, with
    `order="best"`, in the order that lowers its unplanned peak."""
    baseline = simulate(graph, keep_all(graph)).peak_bytes
    if order == "best":
        leaves = _leaf_count(model, inputs)
        graph = _with_loss(best_order(traced.graph, after_output_gradient(traced.graph, traced, leaves))[0],
                           traced, leaves, loss)
    found = plan_step(graph, budget_bytes, solver=solver, **options)
    return replace(found, baseline_peak_bytes=baseline, traced=traced)


def plan_step(graph: Graph, budget_bytes: int, *, solver: str = "auto", time_limit: float = 30.0, workers: int = 0,
              seed: int = 0, deterministic: bool = False, progress: Progress | None = None,
              started: float | None = None, share: bool = True, runtime: str = "exact") -> Plan:
    """A plan that runs on every op of `graph` as scheduled (each op computed where the
    schedule puts it, any number of times), solved on the coarsened graph; when the
    coarse plan peaks over the budget on every op, solve again with the budget reduced by
    the excess. Once the solver finds no plan (or none in time), the best heuristic plan
    within the budget, or else at the smallest budget the solver names (or the
    heuristics reach), is the last try. `share` prices ops writing over inputs they are
    the last to read, as the exact runtime runs them."""
    started = time.perf_counter() if started is None else started
    baseline = simulate(graph, keep_all(graph)).peak_bytes
    coarse = coarsen(graph)
    target, deadline, smallest = budget_bytes, started + time_limit, None
    for _ in range(EXACT_ATTEMPTS):
        remaining = time_limit if deterministic else max(deadline - time.perf_counter(), 1.0)
        exhausted = False
        try:
            solution = solve(coarse.coarse, target, solver, time_limit=remaining, workers=workers, seed=seed,
                             deterministic=deterministic, progress=progress)
        except (InfeasibleBudget, TimeoutError) as error:
            solution, least = ((None, error.smallest) if isinstance(error, InfeasibleBudget)
                               else best_heuristic(coarse.coarse, target))
            if solution is None and least is not None:
                solution = best_heuristic(coarse.coarse, least)[0]
            if solution is None:
                if least is None:
                    raise
                raise InfeasibleBudget(budget_bytes, least, f"{solver} (on the coarsened graph)") from None
            exhausted = True
        fine = coarse.expand(solution.schedule)
        result = simulate(coarse.fine, fine, share=share)
        smallest = result.peak_bytes if smallest is None else min(smallest, result.peak_bytes)
        if result.peak_bytes <= budget_bytes:
            total = graph.total_cost
            return Plan(graph=coarse.fine, schedule=fine, regions=(), model_fingerprint="", budget_bytes=budget_bytes,
                        predicted_peak_bytes=result.peak_bytes, baseline_peak_bytes=baseline,
                        predicted_overhead=result.overhead, solver=solution.solver, status=solution.status,
                        lower_bound=None if solution.lower_bound is None else solution.lower_bound / total - 1,
                        solve_seconds=time.perf_counter() - started, solver_overhead=result.overhead,
                        runtime=runtime, shared=tuple(sorted(result.shared.items())))
        if exhausted:
            break
        target -= result.peak_bytes - budget_bytes
    raise InfeasibleBudget(budget_bytes, smallest, f"{solver} on every op")


def _leaf_count(model: nn.Module, inputs: tuple) -> int:
    """The traced step's leading placeholders: parameters, buffers and input tensors."""
    return len(dict(model.named_parameters())) + len(dict(model.named_buffers())) + len(tree_leaves(inputs))


def _with_loss(graph: Graph, traced: Traced, leaves: int, loss: int) -> Graph:
    """`graph`, a step traced without its loss, with the loss's `loss` bytes as the
    workspace of the first op that reads the output's gradient: the exact runtime leaves
    the loss to eager autograd between its forward and its backward, so that is when
    those bytes are live."""
    if not loss:
        return graph
    workspace = graph.workspace.copy()
    workspace[int(np.argmax(after_output_gradient(graph, traced, leaves)))] += loss
    workspace.flags.writeable = False
    return replace(graph, workspace=workspace)


def _solve_native(rmap: RegionMap, budget_bytes: int, *, solver: str, time_limit: float,
                  workers: int, seed: int, deterministic: bool, progress: Progress | None,
                  started: float) -> Plan:
    """Solve on the coarsened graph, lower the keep set to module regions, and keep the
    cheapest region plan that fits; region plans built for the budget compete, and stand
    alone when the solver finds no plan."""
    graph = rmap.graph
    coarse = coarsen(graph)
    baseline = simulate(graph, keep_all(graph)).peak_bytes
    total = graph.total_cost
    solution, kept = None, None
    try:
        solution = solve(coarse.coarse, budget_bytes, solver, time_limit=time_limit, workers=workers, seed=seed,
                         deterministic=deterministic, progress=progress)
        kept = np.zeros(graph.n, dtype=bool)
        kept[coarse.original[kept_for_backward(coarse.fine, coarse.expand(solution.schedule))]] = True
    except (InfeasibleBudget, TimeoutError):
        pass
    candidates = search(rmap, budget_bytes, kept)
    fitting = [c for c in candidates if c.result.peak_bytes <= budget_bytes]
    if not fitting:
        raise InfeasibleBudget(budget_bytes, min(c.result.peak_bytes for c in candidates),
                               f"{solver} on the native runtime")
    best: Priced = min(fitting, key=lambda c: c.cost)
    result = best.result
    if best.source == "solver":
        solver_overhead = solution.cost / total - 1
        lossless = best.overhead <= solver_overhead + 1e-9
        name, status = solution.solver, solution.status if lossless or solution.status != OPTIMAL else FEASIBLE
    else:
        solver_overhead = best.overhead
        name, status = best.source, FEASIBLE if solution is not None and solution.lower_bound is not None else HEURISTIC
    return Plan(graph=graph, schedule=best.lowering.schedule, regions=best.lowering.regions, model_fingerprint="",
                budget_bytes=budget_bytes, predicted_peak_bytes=result.peak_bytes, baseline_peak_bytes=baseline,
                predicted_overhead=best.overhead, solver=name, status=status,
                lower_bound=None if solution is None or solution.lower_bound is None else solution.lower_bound / total - 1,
                solve_seconds=time.perf_counter() - started, solver_overhead=solver_overhead)


def _region_map(traced: Traced, model: nn.Module, device: str, parallel: Parallel | None = None) -> RegionMap:
    """The traced step (as one rank holds it, under `parallel`) seen as module calls;
    under FSDP no region spans two of its units."""
    graph = _per_rank(traced.graph, traced, model, parallel)
    sequences = {path: tuple(f"{path}.{name}" if path else name for name in module._modules)
                 for path, module in model.named_modules() if isinstance(module, nn.Sequential)}
    unit = unit_of(graph, parallel.units) if isinstance(parallel, FSDP) else None
    return RegionMap(graph, traced.calls, np.array(traced.random, dtype=bool), traced.grad_of, sequences,
                     device_profile(device).dispatch_seconds, unit)


def _per_rank(graph: Graph, traced: Traced, model: nn.Module, parallel: Parallel | None) -> Graph:
    return graph if parallel is None else per_rank(graph, traced.parameters(model), parallel)


def _parallel_of(data: dict[str, Any] | None) -> Parallel | None:
    if data is None:
        return None
    kinds = {"FSDP": FSDP, "DDP": DDP}
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k != "kind"}
    return kinds[data["kind"]](**fields)


def _loss_note(loss_fn: Callable | None, runtime: str = "native") -> str:
    if runtime == "exact":
        return ("room left for it (loss_fn)" if loss_fn is not None else
                "not given: the output's gradient is priced as an input of the backward and the loss as holding "
                "nothing more; pass loss_fn to price it")
    if loss_fn is None:
        return ("not given: priced as a cross-entropy over the last dimension of the largest output (a log-softmax "
                "and two gradients of its size); pass loss_fn to price another")
    return "priced as part of the step (loss_fn)"


def kept_for_backward(graph: Graph, schedule: Schedule) -> np.ndarray:
    """Forward nodes whose first computation serves a read in a backward node's stage (by
    the backward node itself or by a recomputation placed there)."""
    recomputed_at: dict[int, list[int]] = {}
    for i, s, _ in schedule.events:
        if s != i:
            recomputed_at.setdefault(i, []).append(s)
    kept = np.zeros(graph.n, dtype=bool)
    for k, s, _ in schedule.events:
        if not graph.backward[s]:
            continue
        for p in graph.preds[k].tolist():
            if graph.backward[p] or kept[p]:
                continue
            later = [r for r in recomputed_at.get(p, ()) if r < s or (r == s and p < k)]
            kept[p] = not later
    return kept


def _model_device(model: nn.Module) -> str:
    first = next(iter(model.parameters()), None)
    return "cpu" if first is None else profile_for(first.device)
