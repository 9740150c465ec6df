"""CP-SAT interval model after Moccasin (Bartan et al., ICML 2023).

Each node may be computed up to `copies` times: copy 0 in its own stage, later copies in
later stages. A computation in stage s of node v happens at time s·n + v (stages run
their nodes in index order, as the simulator does); its output lives from then until
its last use, a variable end. Every read picks a copy of the input that is live at the
reader's time. Memory is one cumulative constraint over the storage intervals, so the
model has O(n·copies) intervals instead of Checkmate's O(n²) variables. Outputs live
to time n², one past the last computation, so nothing can take their storage over.

Storage is modelled exactly as `simulate` counts it: a view keeps its base's storage
alive (the base copy's storage ends no earlier than any alias read from it), and each
output of a multi-output op holds its own bytes from the op's computation until the
op and every reader-held alias of that part have died.

With `share`, a pointwise op may write over the input `Graph.shareable` names (when that
input owns its storage outright): a boolean per pair of copies that may only be true
when the reader's copy is the last holder of the input's storage, and that ends the
input's interval one instant early, so the two never count together.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from ortools.sat.python import cp_model

from optremat.ilp.bounds import solver_floor, tighten
from optremat.budget import InfeasibleBudget
from optremat.graph import Graph
from optremat.schedule import Schedule, from_computations, simulate
from optremat.solution import FEASIBLE, OPTIMAL, Solution

Progress = Callable[[float, float, float], None]
"""Called with (elapsed seconds, incumbent cost, proven lower bound) as a solve improves."""


def cost_scale(graph: Graph) -> float:
    """Factor that turns node costs into the integers CP-SAT needs: exact for integer
    costs, otherwise a resolution of a millionth of the costliest node."""
    cost = graph.cost
    if np.all(cost == np.round(cost)) and cost.max(initial=0) <= 1e9:
        return 1.0
    return 1e6 / max(float(cost.max(initial=0)), 1e-30)


@dataclass
class _Copy:
    present: cp_model.IntVar | bool
    stage: cp_model.IntVar | int
    start: cp_model.LinearExpr | int
    end: cp_model.IntVar
    storage_end: cp_model.IntVar | None = None
    part_end: dict[int, cp_model.IntVar] = field(default_factory=dict)


class _IntervalModel:
    """The CP-SAT model of one graph; memory capacity is a constant or a variable."""

    def __init__(self, graph: Graph, copies: int, capacity: int | None, share: bool = False) -> None:
        self.graph = graph
        n = graph.n
        self.horizon = n * n + 1
        self.model = cp_model.CpModel()
        self.scale = cost_scale(graph)
        self.copies: list[list[_Copy]] = [[] for _ in range(n)]
        self.uses: dict[tuple[int, int, int, int], cp_model.IntVar] = {}
        self.shares: dict[tuple[int, int, int, int], cp_model.IntVar] = {}
        self._add_copies(copies)
        self._add_reads()
        self._add_storage()
        if share:
            self._add_shares()
        resident = graph.pinned_bytes
        if capacity is None:
            self.capacity = self.model.new_int_var(0, int(graph.size.sum() + graph.workspace.max(initial=0)), "capacity")
        else:
            self.capacity = capacity - resident
        self._add_memory()
        self.extra_cost = sum(round(float(graph.cost[v]) * self.scale) * c.present
                              for v in range(n) for c in self.copies[v][1:])

    def integer_floor(self, extra: float) -> int:
        """The largest value of the integer objective that no plan costing at least
        `extra` beyond one computation of every node can go below: each optional copy may
        be priced below its cost by rounding (not at all when costs are integers)."""
        scaled = self.graph.cost * self.scale
        rounded_down = np.maximum(scaled - np.round(scaled), 0.0)
        slack = sum(float(rounded_down[v]) * (len(c) - 1) for v, c in enumerate(self.copies))
        return max(int(np.floor(extra * self.scale * (1 - 1e-9) - slack)), 0)

    def _add_copies(self, copies: int) -> None:
        g, m, n, H = self.graph, self.model, self.graph.n, self.horizon
        last_reader = [max(g.succs[v].tolist(), default=v) for v in range(n)]
        for v in range(n):
            if g.pinned[v]:
                continue
            own = v * n + v
            if g.output[v]:
                self.copies[v].append(_Copy(True, v, own, m.new_constant(H - 1)))
                continue
            latest = (n - 1) * n + last_reader[v] if len(g.succs[v]) else own
            self.copies[v].append(_Copy(True, v, own, m.new_int_var(own, latest, f"e{v}_0")))
            extra = min(copies, n - v) - 1 if len(g.succs[v]) else 0
            for c in range(1, extra + 1):
                present = m.new_bool_var(f"p{v}_{c}")
                stage = m.new_int_var(v + 1, n - 1, f"s{v}_{c}")
                end = m.new_int_var((v + 1) * n + v, latest, f"e{v}_{c}")
                start = stage * n + v
                prev = self.copies[v][-1]
                m.add(end >= start)
                if c > 1:
                    m.add_implication(present, prev.present)
                    m.add(stage >= prev.stage + 1).only_enforce_if(present)
                m.add(start >= prev.end + 1).only_enforce_if(present)
                m.add(stage == v + 1).only_enforce_if(~present)
                m.add(end == start).only_enforce_if(~present)
                self.copies[v].append(_Copy(present, stage, start, end))

    def _add_reads(self) -> None:
        g, m = self.graph, self.model
        for u, w in g.edges.tolist():
            if g.pinned[u]:
                continue
            for d, reader in enumerate(self.copies[w]):
                choices = []
                for c, source in enumerate(self.copies[u]):
                    y = m.new_bool_var(f"y{u}_{c}_{w}_{d}")
                    if source.present is not True:
                        m.add_implication(y, source.present)
                    m.add(source.stage <= reader.stage).only_enforce_if(y)
                    m.add(source.end >= reader.start).only_enforce_if(y)
                    self.uses[u, c, w, d] = y
                    choices.append(y)
                if reader.present is True:
                    m.add_bool_or(choices)
                else:
                    m.add_bool_or(choices + [~reader.present])

    def _add_storage(self) -> None:
        """Storage ends: a copy's storage outlives every alias read from it (index order
        from the back, so an alias's storage end exists before its base's)."""
        g, m = self.graph, self.model
        plain_alias = (g.alias_of >= 0) & ~g.is_part
        children: list[list[int]] = [[] for _ in range(g.n)]
        for a in np.nonzero(g.alias_of >= 0)[0].tolist():
            children[int(g.alias_of[a])].append(a)
        for x in range(g.n - 1, -1, -1):
            for c, copy in enumerate(self.copies[x]):
                aliases = [a for a in children[x] if plain_alias[a]]
                if aliases:
                    copy.storage_end = m.new_int_var(0, self.horizon - 1, f"x{x}_{c}")
                    m.add(copy.storage_end >= copy.end)
                    self._outlive(copy.storage_end, x, c, aliases)
                else:
                    copy.storage_end = copy.end
                for p in children[x]:
                    if not plain_alias[p]:
                        end = m.new_int_var(0, self.horizon - 1, f"q{p}_{c}")
                        m.add(end >= copy.storage_end)
                        self._outlive(end, x, c, [p])
                        copy.part_end[p] = end

    def _outlive(self, end: cp_model.IntVar, x: int, c: int, holders: list[int]) -> None:
        for a in holders:
            for d, alias in enumerate(self.copies[a]):
                self.model.add(end >= alias.storage_end).only_enforce_if(self.uses[x, c, a, d])

    def _add_shares(self) -> None:
        """Share variables (source node, source copy, op, op copy) for every op that may
        write over an input owning its storage."""
        g, m = self.graph, self.model
        for k in np.nonzero(g.shareable >= 0)[0].tolist():
            p = int(g.shareable[k])
            if g.alias_of[p] >= 0 or g.pinned[p]:
                continue
            for d, reader in enumerate(self.copies[k]):
                for c, source in enumerate(self.copies[p]):
                    z = m.new_bool_var(f"z{p}_{c}_{k}_{d}")
                    m.add_implication(z, self.uses[p, c, k, d])
                    if reader.present is not True:
                        m.add_implication(z, reader.present)
                    m.add(source.storage_end == reader.start).only_enforce_if(z)
                    self.shares[p, c, k, d] = z

    def _add_memory(self) -> None:
        g, m = self.graph, self.model
        intervals, demands = [], []
        self.lengths: list[tuple[cp_model.IntVar, _Copy, cp_model.IntVar]] = []
        self.stops: list[tuple[cp_model.IntVar, cp_model.IntVar]] = []
        handed_over: dict[tuple[int, int], list[cp_model.IntVar]] = {}
        for (p, c, _, _), z in self.shares.items():
            handed_over.setdefault((p, c), []).append(z)

        def interval(copy: _Copy, end: cp_model.IntVar, name: str, early: list[cp_model.IntVar] = ()) -> cp_model.IntervalVar:
            size = m.new_int_var(1, self.horizon, f"len_{name}")
            self.lengths.append((size, copy, end))
            stop = end + 1
            if early:
                stop = m.new_int_var(1, self.horizon, f"stop_{name}")
                m.add(stop == end + 1 - sum(early))
                self.stops.append((stop, end))
            if copy.present is True:
                return m.new_interval_var(copy.start, size, stop, name)
            return m.new_optional_interval_var(copy.start, size, stop, copy.present, name)

        for v in range(g.n):
            for c, copy in enumerate(self.copies[v]):
                if g.alias_of[v] < 0 and g.unit_size[v] > 0:
                    intervals.append(interval(copy, copy.storage_end, f"mem{v}_{c}", handed_over.get((v, c), [])))
                    demands.append(int(g.unit_size[v]))
                for p, end in copy.part_end.items():
                    intervals.append(interval(copy, end, f"part{p}_{c}"))
                    demands.append(int(g.size[p]))
                if g.workspace[v] > 0:
                    if copy.present is True:
                        intervals.append(m.new_fixed_size_interval_var(copy.start, 1, f"ws{v}_{c}"))
                    else:
                        intervals.append(m.new_optional_fixed_size_interval_var(copy.start, 1, copy.present, f"ws{v}_{c}"))
                    demands.append(int(g.workspace[v]))
        m.add_cumulative(intervals, demands, self.capacity)

    def hint(self, schedule: Schedule) -> None:
        """Hint every variable from `schedule` (node copies beyond the model's are dropped)."""
        g, m, n, H = self.graph, self.model, self.graph.n, self.horizon
        by_node: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for i, s, u in schedule.events:
            by_node[i].append((s, u))
        ends: dict[tuple[int, int], int] = {}
        serving: set[tuple[int, int, int, int]] = set()
        readers: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for v in range(n):
            for d, (s, _) in enumerate(by_node[v][:len(self.copies[v])]):
                for u in g.preds[v].tolist():
                    if g.pinned[u]:
                        continue
                    c = next((c for c, (su, uu) in enumerate(by_node[u][:len(self.copies[u])])
                              if su <= s <= uu), None)
                    if c is None:
                        continue
                    serving.add((u, c, v, d))
                    readers.setdefault((u, c), []).append((v, d))
                    ends[u, c] = max(ends.get((u, c), 0), s * n + v)
        storage: dict[tuple[int, int], int] = {}
        value: dict[int, int] = {}
        starts: dict[int, int] = {}
        for v in range(n - 1, -1, -1):
            for c, copy in enumerate(self.copies[v]):
                present = c < len(by_node[v])
                stage = by_node[v][c][0] if present else v + 1
                start = stage * n + v
                end = H - 1 if g.output[v] else max(ends.get((v, c), start), start) if present else start
                if present and c > 0:
                    m.add_hint(copy.present, True)
                elif c > 0:
                    m.add_hint(copy.present, False)
                if not isinstance(copy.stage, int):
                    m.add_hint(copy.stage, stage)
                starts[id(copy)] = start
                value[copy.end.index] = end
                if not g.output[v]:
                    m.add_hint(copy.end, end)
                held = [(a, d) for a, d in readers.get((v, c), []) if g.alias_of[a] == v]
                storage[v, c] = max([end] + [storage[a, d] for a, d in held if not g.is_part[a]])
                value[copy.storage_end.index] = storage[v, c]
                if copy.storage_end is not copy.end:
                    m.add_hint(copy.storage_end, storage[v, c])
                for p, var in copy.part_end.items():
                    value[var.index] = max([storage[v, c]] + [storage[a, d] for a, d in held if a == p])
                    m.add_hint(var, value[var.index])
        for key, y in self.uses.items():
            m.add_hint(y, key in serving)
        for z in self.shares.values():
            m.add_hint(z, False)
        for size, copy, end in self.lengths:
            m.add_hint(size, value[end.index] + 1 - starts[id(copy)])
        for stop, end in self.stops:
            m.add_hint(stop, value[end.index] + 1)

    def schedule(self, solver: cp_model.CpSolver) -> Schedule:
        """The solution as a schedule; each copy lives until the last read it serves."""
        return from_computations(self.graph, [
            (v, int(solver.value(copy.stage))) for v in range(self.graph.n) for copy in self.copies[v][1:]
            if solver.boolean_value(copy.present)])

    def shared(self, solver: cp_model.CpSolver, schedule: Schedule) -> dict[int, int]:
        """The solution's shares as `SimResult.shared` maps them: event index -> input node."""
        return {schedule.event_index[k, int(solver.value(self.copies[k][d].stage))]: p
                for (p, _, k, d), z in self.shares.items() if solver.boolean_value(z)}


LEAST_SECONDS = 0.5
"""Time a solver gets even when building its model used up the limit, so that a hinted
solve can still return its hint."""
RESERVE = 0.02
"""Share of the limit kept for stopping and reading the plan back: on 5,001 nodes CP-SAT
stops 0.4 s after its limit and the schedule takes another 0.1 s to read and price."""


def seconds_left(time_limit: float, started: float) -> float:
    """What is left of `time_limit` since `started`: solver limits cover model building."""
    return max(time_limit * (1 - RESERVE) - (time.perf_counter() - started), LEAST_SECONDS)


PRESOLVE_LIMIT = 1000
"""Graphs with more nodes skip CP-SAT's presolve when a hint is given: on 5,000 nodes
presolve alone outlasts a minute, while the hinted plan is accepted in 2 s without it."""
LIGHT_PRESOLVE_VARIABLES = 20_000
"""Hinted models with more variables get a light presolve (one pass, no probing): on the
500-node random layered graph (27,000 variables) full presolve delays the hinted plan by
9 s, the light one by under 1 s."""


def _presolve(model: _IntervalModel, hinted: bool) -> str:
    if not hinted:
        return "full"
    if model.graph.n > PRESOLVE_LIMIT:
        return "none"
    return "light" if len(model.model.proto.variables) > LIGHT_PRESOLVE_VARIABLES else "full"


def _parameters(solver: cp_model.CpSolver, time_limit: float, started: float, workers: int, seed: int,
                deterministic: bool, presolve: str = "full") -> None:
    """Deterministic runs get `time_limit` of deterministic time, so that they repeat;
    others get what is left of it since `started`."""
    params = solver.parameters
    params.cp_model_presolve = presolve != "none"
    if presolve == "light":
        params.max_presolve_iterations = 1
        params.cp_model_probing_level = 0
    params.num_workers = workers or os.cpu_count() or 1
    params.random_seed = seed
    if deterministic:
        params.interleave_search = True
        params.max_deterministic_time = time_limit
    else:
        params.max_time_in_seconds = seconds_left(time_limit, started)


STALL_SHARE = 0.15
"""A search that finds no better plan for this share of its limit (LEAST_STALL seconds at
least) starts again from its best plan with the next seed: on resnet at 50%, one-minute
searches stall for 15 s or more at 6.96–8.53% overhead, and reach 6.18% (0.73% from the
bound) in 12 of 15 runs with restarts against 2 of 5 without."""
LEAST_STALL = 5.0
RESTART_GAP = 0.01
"""Searches within this gap of their bound run on uninterrupted, since a restart also
discards the proof under way: with restarts at any gap, mobilenet at 0.8 ran its whole
minute at the optimum it had reached in 6 s instead of proving it in 8.6 s."""
RESTART_NODES = 1000
"""Larger graphs keep one search: on the 1,001-node random training graph at 50%,
one-minute searches restarted after 9 s stalls ended at 8.77% and 9.07% overhead against
8.49–8.66% for single searches, whose LNS there improves slowly but steadily."""


class _Watch(cp_model.CpSolverSolutionCallback):
    """Passes each better plan to `report` and stops the search once `stall` seconds pass
    without one while the gap (relative to `offset` plus the objective) exceeds
    RESTART_GAP; never when `stall` is None."""

    def __init__(self, solver: cp_model.CpSolver, stall: float | None, offset: float, bound: float,
                 report: Callable[[float, float], None] | None) -> None:
        super().__init__()
        self.solver, self.stall, self.offset, self.report = solver, stall, offset, report
        self.objective, self.bound = np.inf, bound
        self.stalled = False
        self.timer: threading.Timer | None = None
        solver.best_bound_callback = self._bound

    def on_solution_callback(self) -> None:
        self.objective = self.objective_value
        self._bound(self.best_objective_bound)
        if self.report:
            self.report(self.objective_value, self.bound)
        if self.stall is not None:
            self.cancel()
            self.timer = threading.Timer(self.stall, self._stop)
            self.timer.daemon = True
            self.timer.start()

    def _bound(self, bound: float) -> None:
        self.bound = max(self.bound, bound)

    def _stop(self) -> None:
        if self.objective - self.bound > RESTART_GAP * (self.offset + self.objective):
            self.stalled = True
            self.solver.stop_search()

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


def _search(model: _IntervalModel, time_limit: float, started: float, offset: float, *, workers: int,
            seed: int, deterministic: bool, presolve: str,
            report: Callable[[float, float, float], None] | None = None) -> tuple[int, cp_model.CpSolver, float]:
    """Solves `model` within `time_limit` since `started`, restarting a stalled search
    from its best plan with the next seed (not in deterministic mode, whose runs repeat,
    nor on graphs of over RESTART_NODES nodes); `offset` is what the gap is relative to,
    besides the objective, in objective units.

    Returns the status, the solver holding the best plan and the best objective bound
    any round proved; `report` gets (elapsed seconds, objective, bound) per better plan.
    """
    restarts = not deterministic and model.graph.n <= RESTART_NODES
    stall = max(STALL_SHARE * time_limit, LEAST_STALL) if restarts else None
    best: cp_model.CpSolver | None = None
    bound = -np.inf

    def better(objective: float, round_bound: float) -> None:
        if best is None or objective < best.objective_value:
            report(time.perf_counter() - started, objective, round_bound)

    restart = 0
    while True:
        solver = cp_model.CpSolver()
        _parameters(solver, time_limit, started, workers, seed + restart, deterministic, presolve)
        watch = _Watch(solver, stall, offset, bound, better if report else None)
        status = solver.solve(model.model, watch)
        watch.cancel()
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return (status, solver, bound) if best is None else (cp_model.FEASIBLE, best, bound)
        bound = max(watch.bound, solver.best_objective_bound)
        if best is None or solver.objective_value <= best.objective_value:
            best = solver
        if status == cp_model.OPTIMAL:
            return status, solver, bound
        if not watch.stalled or time_limit * (1 - RESERVE) - (time.perf_counter() - started) < LEAST_STALL:
            return status, best, bound
        model.model.clear_hints()
        model.model.proto.solution_hint.vars.extend(range(len(best.response_proto.solution)))
        model.model.proto.solution_hint.values.extend(list(best.response_proto.solution))
        presolve = _presolve(model, hinted=True)
        restart += 1


def solve_cpsat(graph: Graph, budget: int, *, time_limit: float = 30.0, hint: Schedule | None = None,
                copies: int = 2, workers: int = 0, seed: int = 0, deterministic: bool = False,
                progress: Progress | None = None, share: bool = False) -> Solution:
    """The least-cost schedule whose simulated peak is at most `budget` bytes; with
    `share`, ops may also write over inputs they are the last to hold (`Solution.shared`).

    Raises InfeasibleBudget when the model proves no schedule fits (with the smallest
    feasible budget, found by `min_peak_cpsat`), or TimeoutError when the time limit
    passes with no plan found and no proof either way.
    """
    started = time.perf_counter()
    if budget < graph.pinned_bytes:
        raise InfeasibleBudget(budget, graph.pinned_bytes, "cpsat", proven=True)
    extra = solver_floor(graph, budget, time_limit, share)
    model = _IntervalModel(graph, copies, budget, share)
    model.model.minimize(model.extra_cost)
    if np.isfinite(extra):
        model.model.add(model.extra_cost >= model.integer_floor(extra))
    if hint is not None:
        model.hint(hint)
    def report(elapsed: float, objective: float, bound: float) -> None:
        progress(elapsed, graph.total_cost + objective / model.scale, graph.total_cost + bound / model.scale)

    status, solver, proven = _search(model, time_limit, started, graph.total_cost * model.scale, workers=workers,
                                     seed=seed, deterministic=deterministic,
                                     presolve=_presolve(model, hint is not None), report=report if progress else None)
    if status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"cpsat rejected the model: {model.model.validate()}")
    if status == cp_model.INFEASIBLE:
        raise infeasible(graph, budget, "cpsat", time_limit, copies=copies, share=share)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise TimeoutError(f"cpsat found no plan within {time_limit:g} s and proved none impossible "
                           f"({solver.status_name(status)}); allow more time or a larger budget")
    schedule = model.schedule(solver)
    shared = model.shared(solver, schedule)
    cost = simulate(graph, schedule, share=frozenset(shared)).cost
    bound, optimal = graph.total_cost + proven / model.scale, status == cp_model.OPTIMAL
    if not share:
        bound, optimal = tighten(graph, cost, bound, optimal, extra)
    return Solution(schedule=schedule, solver="cpsat", status=OPTIMAL if optimal else FEASIBLE, cost=cost,
                    lower_bound=bound, seconds=time.perf_counter() - started, copies=copies, shared=shared)


def min_peak_cpsat(graph: Graph, *, max_overhead: float | None = None, time_limit: float = 30.0,
                   copies: int = 2, workers: int = 0, seed: int = 0, deterministic: bool = False,
                   hint: Schedule | None = None, share: bool = False) -> Solution:
    """The schedule with the least peak memory whose overhead is at most `max_overhead`
    (unbounded when None). `lower_bound` is then a proven bound on the peak in bytes."""
    started = time.perf_counter()
    model = _IntervalModel(graph, copies, None, share)
    if max_overhead is not None:
        model.model.add(model.extra_cost <= int(max_overhead * graph.total_cost * model.scale))
    model.model.minimize(model.capacity)
    if hint is not None:
        model.hint(hint)
    status, solver, proven = _search(model, time_limit, started, graph.pinned_bytes, workers=workers, seed=seed,
                                     deterministic=deterministic, presolve=_presolve(model, hint is not None))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise TimeoutError(f"cpsat found no plan within {time_limit:g} s ({solver.status_name(status)})")
    schedule = model.schedule(solver)
    shared = model.shared(solver, schedule)
    return Solution(schedule=schedule, solver="cpsat-min-peak",
                    status=OPTIMAL if status == cp_model.OPTIMAL else FEASIBLE,
                    cost=simulate(graph, schedule, share=frozenset(shared)).cost, shared=shared,
                    lower_bound=graph.pinned_bytes + proven,
                    seconds=time.perf_counter() - started, copies=copies)


def infeasible(graph: Graph, budget: int, planner: str, time_limit: float, copies: int = 2,
               share: bool = False) -> InfeasibleBudget:
    """The error for a budget below what any plan reaches, naming the smallest feasible
    budget the peak-minimising model finds (proven when it solves to optimality)."""
    smallest = min_peak_cpsat(graph, time_limit=time_limit, copies=copies, share=share)
    peak = simulate(graph, smallest.schedule, share=frozenset(smallest.shared)).peak_bytes
    return InfeasibleBudget(budget, peak, planner,
                            proven=smallest.status == OPTIMAL,
                            scope=f" (plans computing each node at most {copies} times)")
