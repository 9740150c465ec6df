"""`compile_backend`: torch.compile with optremat choosing what the backward recomputes.

AOTAutograd hands its partitioner the joint graph of each compiled region; optremat's
`Partitioner` reads it as a Graph, plans it under the budget op by op (any op may be
recomputed, any number of times, where the schedule puts it) and emits the forward and
backward graphs that run that schedule.
Under Inductor it is installed as `custom_partitioner_fn`, so Inductor's joint-graph
passes run first and its code generation after; under aot_eager the graphs run as fx.
"""

from __future__ import annotations

import hashlib
import math
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch._functorch.config as functorch_config
import torch.fx as fx
from torch._functorch.compile_utils import fx_graph_cse
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from optremat.compiler.inductor import compile_in_plan_order, inductor_step, priced
from optremat.compiler.joint import LOSS, JointStep, read_joint
from optremat.compiler.known import known, remember
from optremat.compiler.own_loss import split_own_loss
from optremat.compiler.partition import partition, writable
from optremat.compiler.torch_partitions import FRACTIONS, RIVALS, Rival, torch_keep_set
from optremat.core.budget import InfeasibleBudget, check_budget, resolve_budget
from optremat.core.deadline import ends_before
from optremat.core.graph import Graph, format_bytes
from optremat.core.order import best_order, sunk_views
from optremat.core.schedule import (Schedule, SimResult, from_kept, keep_all, kept_for_backward, simulate,
                                    without_recomputing, without_unread)
from optremat.core.solution import FEASIBLE, OPTIMAL
from optremat.ilp.kept_blocks import block_options, compose, find_blocks
from optremat.ilp.search import check_search, check_time_limit
from optremat.planners.solve import SOLVERS
from optremat.planning.cache import PlanCache
from optremat.planning.chunking import choices, solve_chunked
from optremat.planning.ops import ATTEMPTS, kept_plan, least_plan, plan_step
from optremat.planning.result import Plan
from optremat.tracing.costs import COST_MODELS, DeviceProfile, device_profile, profile_for
from optremat.tracing.extract import LossNotApplicable, depending_on
from optremat.tracing.fingerprint import package_version
from optremat.tracing.lm_loss import AUTO, CausalLMLoss, install

INNER = ("inductor", "aot_eager")
GRACE = 1.0
"""Seconds of the time limit the solver's own search leaves for its plan to be priced as
compiled and filled."""
ORDERS = ("traced", "best")
COMPOSED_FIRST = 5000
"""Graphs of more nodes have the plan composed over their alike blocks made before
PyTorch's partitions: those take seconds each there (3-8 s on a 32-layer Llama's 7,243
nodes, 10.6 s on 14,411), and on the 10 s limit the composition found the cheaper plan
(+5.74% against +6.49% at 64 layers); on smaller graphs the partitions, made first,
leave plans 0.14-0.20 points cheaper at 8 and 16 layers than the composition did."""
COMPOSE_SECONDS = 2.0
"""The most seconds one block's options take to solve (`kept_blocks.block_options`)."""


@dataclass(eq=False)
class Partitioner(CustomPartitionerFn):
    """Plans each joint graph AOTAutograd compiles and partitions it as planned.

    `plans` lists the plan of every graph partitioned, in order (a plan loaded from the
    cache has `cached` set); `graph_inputs` holds the ids of the tensors the graph being
    compiled takes (`read_joint`); `uuid()` names the configuration, so that Inductor's
    caches never hand one configuration's graphs to another.
    """

    budget: int | float | str
    solver: str = "auto"
    time_limit: float = 30.0
    deterministic: bool = False
    seed: int = 0
    workers: int = 0
    cache: str | Path | None = None
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    device: str | DeviceProfile | None = None
    share: bool = False
    inline: bool = False
    order: str = "traced"
    cost_model: str = "roofline"
    plans: list[Plan] = field(default_factory=list)
    graph_inputs: frozenset[int] = frozenset()

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
                 ) -> tuple[fx.GraphModule, fx.GraphModule]:
        num_fwd_outputs = int(kwargs["num_fwd_outputs"])
        gm.graph.eliminate_dead_code()
        if functorch_config.cse:
            # as PyTorch's partitioners do: identical ops (a Llama's attention mask, built once per layer) run once
            gm.graph = fx_graph_cse(gm.graph)
        gm.recompile()
        profile = self._profile(joint_inputs)
        static = list(kwargs.get("static_lifetime_input_indices") or [])

        def read(loss_fn: Callable[[Any], torch.Tensor] | None) -> JointStep:
            step = read_joint(gm, num_fwd_outputs, static, profile, loss_fn, self.cost_model, self.graph_inputs)
            return inductor_step(step, profile) if self.inline else step

        lm = self.loss_fn if isinstance(self.loss_fn, CausalLMLoss) and self.loss_fn.chunks == AUTO else None
        try:
            step = read(self.loss_fn if lm is None else lm.with_chunks(None))
        except LossNotApplicable as error:
            warnings.warn(f"optremat: loss_fn fails on the outputs of compiled graph {len(self.plans) + 1} ({error}), "
                          "so they are priced as a loss taking a cross-entropy over their last dimension would hold "
                          "them (as without loss_fn). Where a graph break splits the model, a graph before the break "
                          "returns what the model computes next, not its output; otherwise loss_fn itself fails on "
                          "the fake tensors a trace runs it on", stacklevel=2)
            lm, step = None, read(None)

        def rival(graph: Graph, fraction: float) -> np.ndarray | None:
            return torch_keep_set(gm, joint_inputs, kwargs, graph, fraction)

        if lm is None or LOSS not in step.graph.names:
            found = self._plan(step, profile, rival, resolve_budget(step.graph, self.budget), self.time_limit)
        else:
            step, found = self._chunked(lm, step, read, profile, rival)
        self.plans.append(found)
        return partition(gm, step, found.graph, found.schedule, num_fwd_outputs, dict(found.shared))

    def uuid(self) -> str:
        parts = [self.budget, self.solver, self.time_limit, self.deterministic, self.seed, self.cache,
                 getattr(self.loss_fn, "__qualname__", self.loss_fn), self.device, self.share, self.inline, self.order,
                 self.cost_model, RIVALS, package_version()]
        return hashlib.sha256(repr(parts).encode()).hexdigest()

    def _profile(self, joint_inputs: Sequence[object]) -> DeviceProfile:
        if self.device is not None:
            return device_profile(self.device)
        devices = [t.device for t in joint_inputs if isinstance(t, torch.Tensor)]
        return device_profile(profile_for(devices[0]) if devices else "cpu")

    def _chunked(self, lm: CausalLMLoss, whole: JointStep, read: Callable[[CausalLMLoss], JointStep],
                 profile: DeviceProfile, rival: Rival) -> tuple[JointStep, Plan]:
        """The step and plan when the loss run between the compiled forward and backward is
        a causal LM's head and loss left to the plan (`lm`, `chunks="auto"`): the step is
        read with the loss whole and in each count of token chunks `choices` allows, each
        planned (`solve_chunked`, the budget a fraction of the whole head's step), the
        cheapest that fits kept, and its count installed where `lm` and every other "auto"
        loss over the same head find it (`lm_loss.install`)."""
        steps = {None: whole}

        def step_for(chunks: int) -> JointStep:
            steps[chunks] = read(lm.with_chunks(chunks))
            return steps[chunks]

        budget_bytes = resolve_budget(whole.graph, self.budget)
        head = repr(lm.head) if isinstance(lm.head, torch.nn.Module) else f"weight {list(lm.head.shape)}"
        found = solve_chunked(whole, step_for, choices(lm.tokens()), head, budget_bytes,
                              lambda step, limit: self._plan(step, profile, rival, budget_bytes, limit),
                              self.time_limit, deterministic=self.deterministic)
        install(lm.weights(substituted=False)[0], found.chunking.chunks)
        return steps[found.chunking.chunks], found

    def _plan(self, step: JointStep, profile: DeviceProfile, rival: Rival, budget_bytes: int,
              time_limit: float) -> Plan:
        """The plan for `step` under `budget_bytes`: from the plan cache when it holds one
        for this graph and budget, else solved in `time_limit` seconds."""
        graph = step.graph
        prices = dict(graph=graph.fingerprint, solver=self.solver, device=profile, runtime="compiled",
                      share=self.share, inline=self.inline, order=self.order, cost_model=self.cost_model,
                      rivals=RIVALS, version=package_version())
        book = (PlanCache.key(costs=hashlib.sha256(graph.cost.tobytes()).hexdigest(), **prices)
                if self.solver == "auto" and not self.deterministic else None)
        if self.cache is None:
            return self._solve(step, budget_bytes, rival, book, time_limit)
        store = PlanCache(self.cache)
        key = store.key(budget=budget_bytes, seed=self.seed, deterministic=self.deterministic, **prices)
        with store.locked(key):
            hit = store.get(key, time_limit, Plan.from_json)
            if hit is not None:
                if book is not None:
                    remember(book, hit)
                return replace(hit, cached=True)
            found = self._solve(step, budget_bytes, rival, book, time_limit)
            store.put(key, found.to_json(), time_limit)
            return found

    def _solve(self, step: JointStep, budget_bytes: int, rival: Rival, book: str | None, time_limit: float
               ) -> Plan:
        """The solver's plan priced as compiled (`_solved`). With solver "auto", the
        cheapest plan that fits wins among it, the keep set composed over the step's alike
        blocks (`_composed`), PyTorch's own partitions of the graph (`rival`, each priced
        as compiled) and the plans found for the same graph at
        other budgets in this process (`known`, under the key `book`; none when
        `deterministic`, whose plans must not depend on what was compiled before), each
        with recomputed tensors kept again while it fits (`_filled`): a partition PyTorch
        chose for a smaller fraction, filled up to the budget, can beat the one it chose
        for the budget (the Llama under Inductor at PyTorch's 0.5 peak: its 0.3 partition
        filled is priced +3.29%, its 0.5 partition filled +4.38%). When none fits, the
        least-peak plan of the heuristics' and those others' is the last try, and its peak
        the smallest budget named: compiling again at it always finds that plan. Unless
        `deterministic`, the solver searches for the time limit less GRACE seconds, and no
        rival partition and no step of a filling is begun that its predecessor's time says
        would end past the limit (but the first partition when nothing fits yet): on a
        32-layer Llama PyTorch's partitions took 3-8 s each, and the 11 of them, filled,
        110 s on a 10 s limit; the solver's plan filled after a search of the whole limit
        ended 1.3-2.5 s past it."""
        started = time.perf_counter()
        deadline = None if self.deterministic else started + time_limit
        graph = self._ordered(step)
        found_before = [] if book is None else [_found_before(plan, budget_bytes) for plan in known(book)]
        with ThreadPoolExecutor(max_workers=1) as pool:
            # PyTorch's partitioner and the pricing of plans run in Python while CP-SAT searches
            # in C++ without the GIL; the pool runs its tasks in turn, the rivals first
            competing = (pool.submit(self._rivals, step, graph, rival, budget_bytes, deadline)
                         if self.solver == "auto" else None)
            filling = None if competing is None else pool.submit(
                lambda: self._fitting(step, found_before, budget_bytes, deadline))
            solved = self._solved(step, graph, budget_bytes, started,
                                  time_limit if deadline is None else max(time_limit - GRACE, time_limit / 2))
            fitting = self._fitting(step, [solved], budget_bytes, deadline)
            if competing is not None:
                fitting += competing.result()[1] + filling.result()
        others = ([] if competing is None else competing.result()[0]) + found_before
        if fitting:
            best = min(fitting, key=lambda c: c.predicted_overhead)
        else:
            best = min([self._as_compiled(step, least_plan(graph, share=self.share)), *others],
                       key=lambda c: c.predicted_peak_bytes)
            if best.predicted_peak_bytes > budget_bytes:
                raise InfeasibleBudget(budget_bytes, best.predicted_peak_bytes,
                                       f"{self.solver} in compiled graph {len(self.plans) + 1} (each graph a model "
                                       "breaks into is planned under the whole budget)")
        best = replace(best, budget_bytes=budget_bytes, solve_seconds=time.perf_counter() - started,
                       compared=tuple((c.solver, c.predicted_peak_bytes, c.predicted_overhead) for c in others))
        if book is not None:
            remember(book, best)
        return best

    def _fitting(self, step: JointStep, plans: list[Plan | None], budget_bytes: int, deadline: float | None
                 ) -> list[Plan]:
        """The plans that fit the budget, with solver "auto" each filled up to it (`_filled`)."""
        fit = [c for c in plans if c is not None and c.predicted_peak_bytes <= budget_bytes]
        return [self._filled(step, c, budget_bytes, deadline) for c in fit] if self.solver == "auto" else fit

    def _rivals(self, step: JointStep, graph: Graph, rival: Rival, budget_bytes: int, deadline: float | None
                ) -> tuple[list[Plan], list[Plan]]:
        """PyTorch's own partitions of the graph (`rival`), each priced as compiled (a keep
        set found at several fractions once), and those that fit filled up to the budget
        as they come (`_fitting`), in the order `_next_fraction` gives: toward the largest
        fraction that fits, which filling usually makes the cheapest. The plan composed
        over the step's alike blocks (`_composed`) fits with them: on a graph of more than
        COMPOSED_FIRST nodes it is made first, on a smaller one last, and not begun when
        solving one block's options would end past `deadline`. No partition is begun that
        would end past `deadline` if it took as long as the last (the first: half the time
        there was), but the first when nothing fits yet (on a 64-layer Llama one partition
        took 10.6 s)."""
        took = 0.0 if deadline is None else (deadline - time.perf_counter()) / 2  # until a partition is timed
        first = graph.n > COMPOSED_FIRST
        composed = self._composed(step, graph, budget_bytes, deadline) if first else []
        fitting = self._fitting(step, composed, budget_bytes, deadline)
        pending = list(FRACTIONS)
        share = budget_bytes / simulate(graph, keep_all(graph)).peak_bytes
        fits: list[float] = []
        fails: list[float] = []
        priced: list[tuple[float, Plan]] = []
        seen: set[bytes] = set()
        while pending and ((not priced and not fitting) or ends_before(deadline, took)):
            begun = time.perf_counter()
            fraction = _next_fraction(pending, share, fits, fails)
            pending.remove(fraction)
            kept = rival(graph, fraction)
            if kept is None:
                break
            if kept.tobytes() in seen:
                continue
            seen.add(kept.tobytes())
            plan = self._as_compiled(step, kept_plan(graph, kept, f"PyTorch min-cut at {fraction:g}", share=self.share))
            priced.append((fraction, plan))
            took = time.perf_counter() - begun
            fitting += self._fitting(step, [plan], budget_bytes, deadline)
            (fits if plan.predicted_peak_bytes <= budget_bytes else fails).append(fraction)
        if not first and ends_before(deadline, self._compose_seconds):
            composed = self._composed(step, graph, budget_bytes, deadline)
            fitting += self._fitting(step, composed, budget_bytes, deadline)
        return composed + [plan for _, plan in sorted(priced, key=lambda item: -item[0])], fitting

    def _composed(self, step: JointStep, graph: Graph, budget_bytes: int, deadline: float | None) -> list[Plan]:
        """The plan of the keep set composed over the step's longest chain of alike blocks
        (`kept_blocks`: one block solved for its options, each block given one, every
        choice priced as compiled) that fits the budget; none when the step has no such
        chain or no choice fits."""
        blocks = find_blocks(graph)
        options = [] if blocks is None else block_options(graph, blocks, self._fixed(step, graph),
                                                          self._compose_seconds, self.deterministic)
        if not options:
            return []

        def price(kept: np.ndarray) -> int:
            return self._run(step, graph, from_kept(graph, kept, reuse=True))[1].peak_bytes

        kept = compose(blocks, options, np.ones(graph.n, dtype=bool), budget_bytes, price, deadline)
        if kept is None:
            return []
        name = f"{len(blocks.nodes)} blocks of {blocks.prefix or 'the model'} composed"
        return [self._as_compiled(step, kept_plan(graph, kept, name, share=self.share))]

    @property
    def _compose_seconds(self) -> float:
        """The most seconds one block's options take to solve."""
        return min(COMPOSE_SECONDS, self.time_limit / 4)

    def _solved(self, step: JointStep, graph: Graph, budget_bytes: int, started: float, time_limit: float
                ) -> Plan | None:
        """optremat's own plan, priced as compiled; when that peaks over the budget, solved
        again with the budget reduced by the excess while time is left (each solve runs
        up to `plan_step`'s few seconds past its time limit, so retries once the time was
        out added those seconds each: 11.5 s on a 2 s limit). None when no solve fits."""
        target, once = budget_bytes, self._fixed(step, graph)
        for attempt in range(ATTEMPTS):
            if attempt and not self.deterministic and time.perf_counter() - started >= time_limit:
                return None
            try:
                found = plan_step(graph, target, solver=self.solver, time_limit=time_limit,
                                  workers=self.workers, seed=self.seed, deterministic=self.deterministic,
                                  started=started, share=self.share, once=once)
            except InfeasibleBudget:
                return None
            compiled = self._as_compiled(step, found)
            if compiled.predicted_peak_bytes <= budget_bytes:
                return compiled
            target -= compiled.predicted_peak_bytes - budget_bytes
        return None

    def _filled(self, step: JointStep, plan: Plan, budget_bytes: int, deadline: float | None) -> Plan:
        """`plan` with the forward tensors it recomputes that cost the most per byte kept for
        the backward instead, as many as still fit (a binary search over that order, cut
        short at `deadline`), when that is cheaper: a partition chosen for another budget
        leaves room unused."""
        graph, schedule = plan.graph, plan.schedule
        recomputed = np.unique(schedule.node[schedule.stage != schedule.node])
        order = recomputed[np.argsort(-graph.cost[recomputed] / np.maximum(graph.size[recomputed], 1), kind="stable")]
        base = kept_for_backward(graph, schedule)
        best, lo, hi, took = plan, 1, len(order), 0.0
        while lo <= hi and ends_before(deadline, took):
            begun = time.perf_counter()
            mid = (lo + hi) // 2
            kept = base.copy()
            kept[order[:mid]] = True
            trial = self._as_compiled(step, kept_plan(graph, kept, f"{plan.solver}, saving more", share=self.share))
            took = time.perf_counter() - begun
            if trial.predicted_peak_bytes > budget_bytes:
                hi = mid - 1
                continue
            lo = mid + 1
            if trial.predicted_overhead < best.predicted_overhead:
                best = trial
        return best

    def _ordered(self, step: JointStep) -> Graph:
        """The step's Graph in the order its plan runs: traced with the backward's views
        run when read (`sunk_views`), or with order="best" the one `best_order` finds
        from there, the loss and all that depends on it after every other op."""
        graph = sunk_views(step.graph)
        if self.order == "traced":
            return graph
        late = depending_on(graph, [graph.names.index(LOSS)]) if LOSS in graph.names else None
        return best_order(graph, late)[0]

    def _as_compiled(self, step: JointStep, found: Plan) -> Plan:
        """`found` as the compiled graphs run it: reruns of fixed ops dropped (their one
        computation kept instead), reruns nothing reads dropped, computations shared where
        the graphs can, priced (with `inline`, as Inductor runs it: `inductor.priced`)."""
        planned = found.graph
        schedule, result = self._run(step, planned, found.schedule)
        dropped = len(schedule.node) < len(found.schedule.node)
        return replace(found, schedule=schedule, status=FEASIBLE if dropped and found.status == OPTIMAL else found.status,
                       predicted_peak_bytes=result.peak_bytes, predicted_overhead=result.overhead,
                       solver_overhead=result.overhead, lower_bound=None, shared=tuple(sorted(result.shared.items())),
                       loss="priced by loss_fn on the outputs that take a gradient" if self.loss_fn else
                       "not given: priced as a cross-entropy over the last dimension of the largest output")

    def _run(self, step: JointStep, graph: Graph, schedule: Schedule) -> tuple[Schedule, SimResult]:
        """`schedule` as the compiled graphs run it (see `_as_compiled`) and its price."""
        schedule = without_unread(graph, without_recomputing(graph, schedule, self._fixed(step, graph)))
        if self.inline:
            return schedule, priced(step, graph, schedule)
        return schedule, simulate(graph, schedule, share=self._shares(step, graph, schedule))

    @staticmethod
    def _fixed(step: JointStep, graph: Graph) -> np.ndarray:
        """`step.fixed` over the nodes of `graph`, the step's Graph in another order."""
        fixed = dict(zip(step.graph.names, step.fixed.tolist()))
        return np.array([fixed[n] for n in graph.names])

    def _shares(self, step: JointStep, graph: Graph, schedule: Schedule) -> frozenset[int]:
        """The computations of `schedule` that write over an input they are the last to
        hold, where the compiled graph can (`writable`) and the input is no tensor the
        forward saved for the backward: a second backward of a graph kept with
        `retain_graph=True` reads those again (it stopped on their versions); none unless
        `share`."""
        if not self.share:
            return frozenset()
        can = writable(step, graph)
        return frozenset(e for e, over in simulate(graph, schedule, share=True).shared.items()
                         if can[schedule.node[e]] and not _saved_for_backward(graph, schedule, e, over))


def _saved_for_backward(graph: Graph, schedule: Schedule, event: int, node: int) -> bool:
    """Whether the computation `event`, in the backward, reads `node` in storage the
    forward computed: a tensor saved for the backward (or a view of one)."""
    made = np.nonzero(schedule.node[:event] == graph.storage_root[node])[0]
    return (bool(graph.backward[schedule.stage[event]]) and len(made) > 0
            and not graph.backward[schedule.stage[made[-1]]])


def _next_fraction(pending: list[float], share: float, fits: list[float], fails: list[float]) -> float:
    """The fraction of `pending` to partition next: the nearest `share` (the budget's
    share of the unplanned peak) at first; then those between the largest fraction whose
    partition fits and the smallest whose partition does not, nearest the one that fits
    (or, before any fits, the one that does not); then the rest, nearest the same one."""
    low, high = max(fits, default=-math.inf), min(fails, default=math.inf)
    at = low if fits else high if fails else share
    return min(pending, key=lambda f: (not low < f < high, abs(f - at), -f))


def _found_before(plan: Plan, budget_bytes: int) -> Plan:
    """A plan found for the same graph at another budget, as a candidate at `budget_bytes`:
    named for the budget it was planned for, optimal only if that budget was larger."""
    source = plan.solver.split(" (planned for ")[0]
    return replace(plan, solver=f"{source} (planned for {format_bytes(plan.budget_bytes)})",
                   status=FEASIBLE if plan.status == OPTIMAL and plan.budget_bytes < budget_bytes else plan.status)


class Backend:
    """A torch.compile backend: `inner` compiles the forward and backward graphs that the
    `partitioner` cuts from each joint graph. `plans` lists the plans made so far."""

    def __init__(self, partitioner: Partitioner, inner: str, head_chunks: str | None = AUTO) -> None:
        self.partitioner = partitioner
        self.inner = inner
        self.head_chunks = head_chunks

    @property
    def plans(self) -> list[Plan]:
        return self.partitioner.plans

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        """The compiled `gm`. Where it ends in its own LM head and cross-entropy
        (`own_loss.split_own_loss`) and no `loss_fn` is given, the graph before them is
        compiled, planned with them run after it whole or in token chunks; where the plan
        runs them in chunks, they run so after it (the logits returned as None), else the
        whole graph is compiled and planned again as it is (where no plan of it fits,
        the graph before them runs with them whole after it). Not with `head_chunks` None.
        The chunks chosen are not installed for the head's other losses (`lm_loss.install`)."""
        found = (None if self.partitioner.loss_fn is not None or self.head_chunks is None
                 else split_own_loss(gm, example_inputs))
        if found is None:
            return self._compiled(gm, example_inputs)
        split, hidden = found
        made = len(self.plans)
        priced = split.priced(example_inputs, hidden)
        installed = priced.running_chunks()
        self.partitioner.loss_fn = priced
        try:
            prefix = self._compiled(split.prefix, example_inputs)
        finally:
            self.partitioner.loss_fn = None
            install(priced.weights(substituted=False)[0], installed)
        chunking = self.plans[-1].chunking if len(self.plans) > made else None
        chunks = None if chunking is None else chunking.chunks
        if chunks is None:
            planned = len(self.plans)
            try:
                whole = self._compiled(gm, example_inputs)
            except InfeasibleBudget:
                if planned == made:  # the graph before the head planned nothing: no plan fits
                    raise
                del self.plans[planned:]
            else:
                del self.plans[made:planned]
                return whole
        self.plans[-1] = replace(self.plans[-1], loss=(
            f"the model's own, taken in its forward: its LM head and cross-entropy run after the compiled graph "
            f"{'whole' if chunks is None else f'in {chunks} token chunks'}, so the logits it returns are None"))
        return split.run(prefix, chunks)

    def _compiled(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        self.partitioner.graph_inputs = frozenset(id(t) for t in example_inputs if isinstance(t, torch.Tensor))
        if self.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx

            # with Inductor's pattern passes on, the graphs it generates no longer hold what the
            # plan prices (a Llama step planned at 118.8 MiB measured 136.3 MiB; 118.8 without);
            # with its buffer reuse on, a dead buffer stays allocated until a later one of its size
            # takes it over (gpt-mini's MLP tensors through an attention backward: 65.97 MB against
            # 64.41 priced; 64.44 without, at no measured cost in step time);
            # a graph from Inductor's own caches would skip the partitioner, leaving no plan to
            # inspect: the plan cache (`cache`) makes the second compile cheap instead
            with functorch_config.patch(enable_autograd_cache=False):
                return compile_fx(gm, example_inputs, inner_compile=compile_in_plan_order, config_patches={
                    "custom_partitioner_fn": self.partitioner, "pattern_matcher": False, "fx_graph_cache": False,
                    "allow_buffer_reuse": False})
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=self.partitioner,
                            keep_inference_input_mutations=True)(gm, example_inputs)


def compile_backend(budget: int | float | str, *, inner: str = "inductor", solver: str = "auto",
                    time_limit: float = 30.0, deterministic: bool = False, seed: int = 0, workers: int = 0,
                    cache: str | Path | None = None, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                    device: str | DeviceProfile | None = None, order: str = "traced",
                    cost_model: str = "roofline", head_chunks: str | None = AUTO) -> Backend:
    """A `torch.compile` backend that plans every compiled training step under `budget`:
    `torch.compile(model, backend=optremat.compile_backend("6GiB"), dynamic=False)`.

    `budget` is bytes, a size such as "6GiB", or a fraction in (0, 1] of the step's
    unplanned simulated peak, and bounds the whole step (parameters, inputs, gradients
    and the loss computed on the outputs included; `loss_fn` prices that loss, a
    cross-entropy over the largest output's last dimension when not given: it is called
    on the compiled graph's outputs that take a gradient, a tensor when there is one (the
    logits), else a list of them, since the model's output structure is not part of the
    graph). A `loss_fn` that is an `optremat.CausalLMLoss` with `chunks="auto"`, run on the
    compiled model's hidden states, has its token chunks chosen with the plan (`_chunked`)
    and runs in them; a fractional budget is then of the step with the whole head. A graph
    ending in its own LM head and cross-entropy (nanoGPT's loss, taken in the forward) has
    them taken out and planned so when no `loss_fn` is given (`Backend.__call__`); where the
    plan runs them after the graph the forward returns its logits as None (the loss alone
    read them). `head_chunks=None` leaves them in the graph, the logits returned.
    `inner` is "inductor" or "aot_eager" (under which pointwise ops also write
    over inputs they are the last to read, wherever the graphs can); `solver`,
    `time_limit`, `deterministic`, `seed` and `workers` are `plan()`'s; `cache`, a
    directory, keeps plans across processes, so the second compile of the same graph
    solves nothing. `order="best"` lets the graphs run independent ops in another order
    where that lowers the unplanned peak (`optremat.core.order.best_order`). `cost_model` is
    "roofline" (ops priced from FLOPs and bytes over `device`'s profile) or "profile"
    (each op of the joint graph timed on this machine as the graph is planned, on random
    tensors of its shapes). With `solver="auto"`, PyTorch's own min-cut partitions of the
    graph compete (`plan.compared`), and so do the plans found for the same graph at other
    budgets in this process (not with `deterministic`). A budget no plan meets raises
    InfeasibleBudget (wrapped by dynamo) naming the smallest budget found.
    Create one backend per configuration: dynamo reuses compiled graphs per backend object.
    """
    if inner not in INNER:
        raise ValueError(f"unknown inner compiler {inner!r}; choose one of {', '.join(INNER)}")
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    check_budget(budget)
    check_time_limit(time_limit)
    check_search(workers, seed)
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; choose one of {', '.join(ORDERS)}")
    if cost_model not in COST_MODELS:
        raise ValueError(f"unknown cost model {cost_model!r}; choose one of {', '.join(COST_MODELS)}")
    if head_chunks not in (AUTO, None):
        raise ValueError(f'head_chunks must be "auto" or None, not {head_chunks!r}')
    return Backend(Partitioner(budget, solver, time_limit, deterministic, seed, workers, cache, loss_fn, device,
                               share=inner == "aot_eager", inline=inner == "inductor", order=order,
                               cost_model=cost_model), inner, head_chunks)
