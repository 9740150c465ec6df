"""The Plan: one model's keep / recompute decisions and what they cost at one input
shape, as a runtime reads them and as they are saved (versioned JSON)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from optremat.graph import Graph, format_bytes
from optremat.ilp.layout import ALIGNMENT, layout
from optremat.regions import Region
from optremat.schedule import Schedule
from optremat.sharding import DDP, FSDP, Parallel

FORMAT_VERSION = 4
READS = (3, 4)
"""The plan format versions this optremat reads (4 added `compared`)."""


@dataclass(frozen=True, eq=False)
class Plan:
    """A plan for one model: what to keep, what to recompute, and its price at one input shape.

    `predicted_peak_bytes` and `predicted_overhead` are the simulated numbers of the
    schedule its `runtime` executes at the shape it was priced for (`graph`): "native"
    (`optremat.apply` checkpoints its `regions`, keyed by module call and op occurrence,
    so it runs at any shape; `optremat.reprice` prices it at another) or "compiled" (the
    forward and backward graphs of one torch.compile region). `lower_bound` is a proven
    lower bound on the overhead and `status` is OPTIMAL only when the plan meets it: for a
    native plan the memory bound of the step's graph, which holds for every plan the
    native runtime can run; for a compiled plan the solver's, in its planning model (the
    coarsened graph, each op computed at most a few times); None when nothing is proven.
    `loss` says how the loss computed after the model was priced. A plan for a data-parallel job (`parallel`) is priced for one rank and its budget is per rank.
    `compared` lists the other planners' plans that competed for this one, priced the same
    way: (name, predicted peak bytes, predicted overhead) each (a compiled plan's rivals
    are PyTorch's own partitions of the graph).
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
    compared: tuple[tuple[str, int, float], ...] = ()
    cached: bool = field(default=False, compare=False)

    @property
    def fingerprint(self) -> str:
        """The planned graph's fingerprint (ops, tensor types, edges)."""
        return self.graph.fingerprint

    def decisions(self) -> dict[str, str]:
        """For every forward op of the model: keep, recompute, share (a view or in-place
        result that holds another tensor's storage, or an op a compiled graph runs over
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
               "compiled": f"torch.compile's forward and backward graphs run the schedule op by op "
                           f"({len(self.shared)} ops write over inputs they read last)"}[self.runtime]
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
            *([self._rivals()] if self.compared else []),
            *([f"per rank: {self.parallel.describe()}"] if self.parallel else []),
            f"memory layout: an arena of {format_bytes(arena.arena_bytes)} (greedy by size, {arena.fragmentation:+.1%} "
            f"over the {format_bytes(arena.live_bytes)} live at most, allocations aligned to {ALIGNMENT} bytes)",
        ])

    def _rivals(self) -> str:
        """The cheapest of the plans `compared` that fits the budget, or the least-peak one."""
        fitting = [c for c in self.compared if c[1] <= self.budget_bytes]
        if fitting:
            name, peak, overhead = min(fitting, key=lambda c: c[2])
            return (f"compared with {len(self.compared)} other plans priced the same way; the cheapest within the "
                    f"budget: {name}, {format_bytes(peak)}, {overhead:+.2%}")
        name, peak, _ = min(self.compared, key=lambda c: c[1])
        return (f"compared with {len(self.compared)} other plans priced the same way; none fits the budget "
                f"(least peak: {name}, {format_bytes(peak)})")

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
            "compared": [list(c) for c in self.compared],
            "parallel": None if self.parallel is None else {"kind": type(self.parallel).__name__,
                                                           **asdict(self.parallel)},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Plan":
        if data.get("format") != "optremat.plan":
            raise ValueError("not an optremat plan (missing format tag)")
        if data.get("version") not in READS:
            raise ValueError(f"plan format version {data.get('version')} is not supported "
                             f"(this optremat reads {', '.join(map(str, READS))}); plan again")
        fields = {k: v for k, v in data.items() if k not in ("format", "version", "graph", "schedule", "regions",
                                                             "shared", "mutated_buffers", "parallel", "compared")}
        return cls(graph=Graph.from_json(data["graph"]), schedule=Schedule.from_json(data["schedule"]),
                   regions=tuple(Region.from_json(r) for r in data["regions"]),
                   shared=tuple((int(k), int(p)) for k, p in data["shared"]),
                   mutated_buffers=tuple(data["mutated_buffers"]), parallel=_parallel_of(data.get("parallel")),
                   compared=tuple((str(n), int(p), float(o)) for n, p, o in data.get("compared", [])), **fields)

    def save(self, path: str | Path) -> None:
        """Write the plan as versioned JSON (atomically: a reader never sees half a plan)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_json()))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_json(json.loads(Path(path).read_text()))


def _parallel_of(data: dict[str, Any] | None) -> Parallel | None:
    if data is None:
        return None
    kinds = {"FSDP": FSDP, "DDP": DDP}
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k != "kind"}
    return kinds[data["kind"]](**fields)


def loss_note(loss_fn: Callable | None) -> str:
    """How a native plan priced the loss computed after the model (`Plan.loss`)."""
    if loss_fn is None:
        return ("not given: priced as a cross-entropy over the last dimension of the largest output (a log-softmax "
                "and two gradients of its size); pass loss_fn to price another")
    return "priced as part of the step (loss_fn)"
