"""Head-to-head on one model: every planner at every budget (simulated), and optremat's
plans against what a user would otherwise run (measured).

Peers: no rematerialization; `torch.utils.checkpoint` around every repeated block (what
most people write by hand); PyTorch's own planner, `activation_memory_budget` under
`torch.compile`, at several budgets; optremat at the measured peak of each peer, so the
comparison is at equal memory. Every figure is measured: the peak from the CPU
profiler's memory events (the CUDA allocator on a GPU), the overhead as the median over
interleaved pairs of steps against the same mode's unplanned baseline (eager against
eager, compiled against compiled).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from optremat.core.budget import InfeasibleBudget, resolve_budget
from optremat.core.coarsen import Coarsened, coarsen
from optremat.core.graph import Graph, format_bytes
from optremat.core.schedule import keep_all, simulate
from optremat.heuristics import NotAChain
from optremat.planners.solve import SOLVERS, solve
from optremat.planning.model import plan
from optremat.planning.result import Plan
from optremat.runtime.apply import apply, remove
from optremat.runtime.measure import measure_peak, step_resident

Step = Callable[[], Any]
Report = Callable[["Measured"], None]


@dataclass(frozen=True)
class Measured:
    """One method run on the model: its measured peak and step-time overhead.

    `overhead` is against `baseline` (the unplanned step in the same mode);
    `setup_seconds` is planning or compilation time plus the first (warm-up) step, which
    holds any lazy work; `predicted_peak_bytes` and
    `predicted_overhead` are the plan's own predictions where the method makes them;
    `matches` names the peer whose measured peak was the plan's budget. `note` explains
    a method that did not run (then the figures are zero).
    """

    method: str
    baseline: str
    peak_bytes: int = 0
    overhead: float = 0.0
    step_seconds: float = 0.0
    setup_seconds: float = 0.0
    predicted_peak_bytes: int | None = None
    predicted_overhead: float | None = None
    matches: str | None = None
    note: str = ""

    @property
    def ran(self) -> bool:
        return not self.note


def repeated_blocks(model: nn.Module) -> list[str]:
    """Names of the modules a user would checkpoint by hand: the composite children of
    every `nn.Sequential` / `nn.ModuleList`, outermost only (a transformer's blocks, a
    ResNet's residual blocks, a U-Net's conv stages)."""
    found: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in found):
            continue
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            found += [f"{name}.{child}" if name else child for child, sub in module.named_children()
                      if any(True for _ in sub.children())]
    return found


@contextlib.contextmanager
def checkpointed_blocks(model: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """Run each named submodule under non-reentrant `torch.utils.checkpoint` while the
    context is open; the model is restored on exit."""
    modules = [model.get_submodule(name) for name in names]
    for module in modules:
        inner = module.forward
        module.forward = lambda *a, _f=inner, **k: checkpoint(_f, *a, use_reentrant=False, **k)
    try:
        yield
    finally:
        for module in modules:
            del module.forward


@contextlib.contextmanager
def hf_checkpointing(model: nn.Module) -> Iterator[None]:
    """transformers' own per-block checkpointing (`gradient_checkpointing_enable`, not
    reentrant) while the context is open. On exit the model is as it was: disabling
    leaves behind the input hook enabling added, one more each time, and every hook
    added is a recompile of a compiled step of the same model."""
    hooks = model.get_input_embeddings()._forward_hooks
    before = set(hooks)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        yield
    finally:
        model.gradient_checkpointing_disable()
        for key in set(hooks) - before:
            del hooks[key]


def torch_budget_backend(budget: float, backend: str = "aot_eager_decomp_partition") -> Callable:
    """A `torch.compile` backend that partitions with `activation_memory_budget=budget`.

    Each call makes a distinct backend callable, so compiled variants of one model do not
    share Dynamo's cache (it guards on the backend's identity), and the budget is set only
    while this backend compiles rather than globally.
    """
    import torch._functorch.config as functorch_config
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(backend)

    def compile_with_budget(graph_module: torch.fx.GraphModule, example_inputs: list) -> Callable:
        with functorch_config.patch(activation_memory_budget=budget):
            return inner(graph_module, example_inputs)

    return compile_with_budget


def compare(model: nn.Module, inputs: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor], *,
            torch_budgets: Sequence[float] = (0.5, 0.1), backend: str = "aot_eager_decomp_partition",
            fractions: Sequence[float] = (), runs: int = 5, time_limit: float = 30.0,
            report: Report | None = None) -> list[Measured]:
    """Measure every peer on `loss_fn(model(*inputs))`, then optremat at each peer's
    measured peak and at each fraction of the unplanned peak in `fractions`.

    `report` is called with each result as it is measured (long runs show progress).
    """
    session = _Session(model, tuple(inputs), loss_fn, runs, report)
    eager = ("eager", session.step_of(model))
    eager[1]()
    session.measure("no remat", eager, eager[1], 0.0)
    unplanned_peak = session.results[0].peak_bytes
    _per_block(session, eager)
    if torch_budgets:
        _torch_budgets(session, eager, torch_budgets, backend)
    targets = [(r.method, r.peak_bytes) for r in session.results if r.ran and r.method != "no remat"]
    targets += [(f"{fraction:.0%} of unplanned", int(fraction * unplanned_peak)) for fraction in fractions]
    for matches, budget in targets:
        _optremat(session, eager, matches, budget, unplanned_peak, time_limit)
    return session.results


class _Session:
    """One comparison: the model's training step, the results measured so far (each
    passed on to `report`), and how a method is measured against its baseline."""

    def __init__(self, model: nn.Module, inputs: tuple, loss_fn: Callable[[Any], torch.Tensor], runs: int,
                 report: Report | None) -> None:
        self.model, self.inputs, self.loss_fn, self.runs, self.report = model, inputs, loss_fn, runs, report
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.resident = step_resident(model, inputs, loss_fn)
        self.results: list[Measured] = []

    def step_of(self, module: Callable) -> Step:
        return lambda: torch.autograd.grad(self.loss_fn(module(*self.inputs)), self.params)

    def add(self, result: Measured) -> None:
        self.results.append(result)
        if self.report is not None:
            self.report(result)

    def measure(self, method: str, baseline: tuple[str, Step], step: Step, setup: float, **extra: Any) -> None:
        """`step`'s measured peak, and its time against `baseline`'s: the median of `runs`
        per-pair ratios, each pair run back to back."""
        base_name, base_step = baseline
        started = time.perf_counter()
        step()
        setup += time.perf_counter() - started
        peak = measure_peak(step, resident=self.resident).peak_bytes
        ratios, times = [], []
        for _ in range(self.runs):
            pair = []
            for s in (base_step, step):
                begin = time.perf_counter()
                s()
                pair.append(time.perf_counter() - begin)
            ratios.append(pair[1] / pair[0])
            times.append(pair[1])
        self.add(Measured(method, base_name, peak, statistics.median(ratios) - 1, statistics.median(times), setup,
                          **extra))


def _per_block(session: _Session, eager: tuple[str, Step]) -> None:
    """Per-block checkpointing of the model's repeated blocks, as HF and torchtitan do it."""
    blocks = repeated_blocks(session.model)
    if not blocks:
        session.add(Measured("checkpoint blocks", "eager", note="no repeated blocks to checkpoint"))
        return

    def per_block() -> Any:
        with checkpointed_blocks(session.model, blocks):
            return eager[1]()

    session.measure(f"checkpoint {len(blocks)} blocks", eager, per_block, 0.0)


def _torch_budgets(session: _Session, eager: tuple[str, Step], budgets: Sequence[float], backend: str) -> None:
    """PyTorch's `activation_memory_budget` at 1 (timed against eager) and at each of
    `budgets` (timed against the compiled step at 1)."""
    compiled_baseline = None
    for budget in (1.0,) + tuple(budgets):
        started = time.perf_counter()
        try:
            step = session.step_of(torch.compile(session.model, backend=torch_budget_backend(budget, backend)))
            step()
        except Exception as error:  # a compiler failure is a result to report, not a crash
            session.add(Measured(f"torch budget {budget:g}", backend, note=f"{type(error).__name__}: {error}"[:200]))
            continue
        setup = time.perf_counter() - started
        session.measure(f"torch budget {budget:g}", compiled_baseline or eager, step, setup)
        compiled_baseline = compiled_baseline or (backend, step)


def _optremat(session: _Session, eager: tuple[str, Step], matches: str, budget: int, unplanned_peak: int,
              time_limit: float) -> None:
    """optremat planned at `budget` (the peak of the method it `matches`) and measured."""
    started = time.perf_counter()
    try:
        planned = plan(session.model, session.inputs, budget, loss_fn=session.loss_fn, time_limit=time_limit)
    except InfeasibleBudget as error:
        session.add(Measured("optremat", "eager", matches=matches,
                             note=f"infeasible: smallest {format_bytes(error.smallest)} "
                                  f"({error.smallest / unplanned_peak:.0%} of the measured unplanned peak)"))
        return
    except ValueError as error:
        session.add(Measured("optremat", "eager", matches=matches, note=str(error).split(";")[0]))
        return
    session.measure("optremat", eager, under(session.model, planned, eager[1]), time.perf_counter() - started,
                    predicted_peak_bytes=planned.predicted_peak_bytes, predicted_overhead=planned.predicted_overhead,
                    matches=matches)


def under(model: nn.Module, planned: Plan, step: Callable[[], Any]) -> Callable[[], Any]:
    """`step` run with `planned` installed on `model`, which runs unplanned between calls
    (so that unplanned and planned steps interleave in one process)."""
    def run() -> Any:
        apply(model, planned)
        try:
            return step()
        finally:
            remove(model)
    return run


@dataclass(frozen=True)
class Simulated:
    """One planner at one budget (a fraction of the unplanned peak), priced by simulate()
    on every op: `overhead` and `seconds` when it found a plan; otherwise `note` says why
    (with the smallest peak it reached, as a fraction, when the budget was infeasible)."""

    planner: str
    fraction: float
    overhead: float | None = None
    seconds: float = 0.0
    detail: str = ""
    note: str = ""

    def cell(self) -> str:
        return self.note or f"{self.overhead:.1%} ({self.seconds:.1f} s)"


PLANNERS = tuple(name for name in SOLVERS if name not in ("cpsat", "ilp"))
"""The registry's planners the simulated comparison runs: every one but the unhinted exact
models, which `auto` runs hinted (benchmarks/exact.md compares those)."""
LP_NODES = 150
"""Largest coarse graph the LP relaxation is tried on (it has O(n²) variables)."""


def compare_planners(graph: Graph, fractions: Sequence[float], planners: Sequence[str] = PLANNERS, *,
                     time_limit: float = 30.0, report: Callable[[Simulated], None] | None = None) -> list[Simulated]:
    """Every planner at every budget on the coarsened `graph`, each plan priced on every op."""
    coarsened = coarsen(graph)
    unplanned = simulate(graph, keep_all(graph)).peak_bytes
    results = []
    for fraction in fractions:
        budget = resolve_budget(graph, fraction)
        for planner in planners:
            results.append(_simulated(coarsened, planner, fraction, budget, unplanned, time_limit))
            if report is not None:
                report(results[-1])
    return results


def _simulated(coarsened: Coarsened, planner: str, fraction: float, budget: int, unplanned: int,
               time_limit: float) -> Simulated:
    if planner == "lp-rounding" and coarsened.coarse.n > LP_NODES:
        return Simulated(planner, fraction, note="skipped (LP of O(n²) variables)")
    try:
        solution = solve(coarsened.coarse, budget, solver=planner, time_limit=time_limit)
    except NotAChain:
        return Simulated(planner, fraction, note="n/a (no backward)")
    except InfeasibleBudget as error:
        return Simulated(planner, fraction, note=f"infeasible (min {error.smallest / unplanned:.0%})")
    except TimeoutError:
        return Simulated(planner, fraction, note="no plan in time")
    result = simulate(coarsened.fine, coarsened.expand(solution.schedule))
    if result.peak_bytes > budget:
        raise AssertionError(f"{planner} returned a plan over budget: {result.peak_bytes} > {budget}")
    gap = "" if solution.gap is None else f", gap {solution.gap:.2%}"
    return Simulated(planner, fraction, result.overhead, solution.seconds, f"{solution.solver} {solution.status}{gap}")
