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

from dataclasses import dataclass, field

import numpy as np
from ortools.sat.python import cp_model

from optremat.core.graph import Graph
from optremat.core.schedule import Schedule, from_computations


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


class IntervalModel:
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
        be priced below its cost by rounding, by `rounding` in all."""
        return max(int(np.floor(extra * self.scale * (1 - 1e-9) - self.rounding)), 0)

    @property
    def rounding(self) -> float:
        """How far from its cost the integer objective may price a plan, either way: the
        sum, over the optional copies, of what rounding moves each by (0 when costs are
        integers). Plans closer than this in the objective are not told apart by it."""
        scaled = self.graph.cost * self.scale
        moved = np.abs(scaled - np.round(scaled))
        return sum(float(moved[v]) * (len(c) - 1) for v, c in enumerate(self.copies))

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
