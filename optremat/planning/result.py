"""The Plan: one model's keep / recompute decisions and what they cost at one input
shape, as a runtime reads them and as they are saved (versioned JSON)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from contextlib import suppress
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import numpy as np

from optremat.core.graph import Graph, format_bytes
from optremat.core.schedule import Schedule
from optremat.core.sharding import DDP, FSDP, Parallel
from optremat.ilp.layout import ALIGNMENT, layout
from optremat.planners.regions import Region

FORMAT_VERSION = 6
READS = (5, 6)
"""The plan format versions this optremat reads (5 added `checksum`, which every plan
read must carry; 6 added `chunking`, None in a plan of version 5)."""
RUNTIMES = ("native", "compiled")
"""What may run a plan (`Plan.runtime`)."""
PARALLEL_KINDS = {"FSDP": FSDP, "DDP": DDP}
"""The data-parallel jobs a plan file may name, by the `kind` it saves them under."""


@dataclass(frozen=True)
class Chunking:
    """How a plan runs a causal LM's head and its loss (`optremat.CausalLMLoss` with
    `chunks="auto"`, or a transformers causal LM's own, `optremat.tracing.causal_lm`):
    `chunks` token chunks (None: whole), chosen among `tried` (the counts priced, each
    with the region plan best for it). `head` names the head's weight as
    `named_parameters` does, where `optremat.apply` installs the choice.
    `unplanned_peak_bytes` is the step's peak with these chunks and no module call
    checkpointed (the plan's `baseline_peak_bytes` is the whole head's)."""

    head: str
    chunks: int | None
    unplanned_peak_bytes: int
    tried: tuple[int | None, ...]

    def describe(self) -> str:
        """One line: how the head runs, and among what it was chosen."""
        shown = ["whole" if k is None else f"{k} chunks" for k in self.tried]
        how = "whole" if self.chunks is None else f"in {self.chunks} token chunks"
        return f"LM head {self.head} and its loss run {how} (chosen among {', '.join(shown)})"

    def to_json(self) -> dict[str, Any]:
        return {"head": self.head, "chunks": self.chunks, "unplanned_peak_bytes": self.unplanned_peak_bytes,
                "tried": list(self.tried)}


class PlanFileError(ValueError):
    """A plan file (or its JSON) that optremat cannot read back as the plan it saved:
    not JSON, not a plan, another format version, changed after it was saved, or
    malformed."""


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
    A native plan composed from a chain of identical blocks (`solver` says so) is bounded
    and proven over plans of regions inside those blocks only.
    `loss` says how the loss computed after the model was priced, `cost_model` and `device`
    what priced its ops (a built-in profile's name, or the `DeviceProfile` itself; a plan
    made again at another shape is priced alike). A plan for
    a data-parallel job (`parallel`) is priced for one rank and its budget is per rank.
    `compared` lists the other planners' plans that competed for this one, priced the same
    way: (name, predicted peak bytes, predicted overhead) each (a compiled plan's rivals
    are PyTorch's own partitions of the graph). `chunking` says how the LM head and its
    loss run when the plan chose it (`optremat.CausalLMLoss(..., chunks="auto")`, or a
    transformers causal LM's own loss).
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
    chunking: Chunking | None = None
    cost_model: str = "roofline"
    device: Any = "cpu"
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
            *([self._chunked()] if self.chunking else []),
            *([self._rivals()] if self.compared else []),
            *([f"per rank: {self.parallel.describe()}"] if self.parallel else []),
            f"memory layout: an arena of {format_bytes(arena.arena_bytes)} (greedy by size, {arena.fragmentation:+.1%} "
            f"over the {format_bytes(arena.live_bytes)} live at most, allocations aligned to {ALIGNMENT} bytes)",
        ])

    def _chunked(self) -> str:
        """The LM head's chunking and the bytes it saves the unplanned step."""
        chunking = self.chunking
        saved = self.baseline_peak_bytes - chunking.unplanned_peak_bytes
        return (f"{chunking.describe()}: unplanned peak {format_bytes(chunking.unplanned_peak_bytes)}, "
                f"{format_bytes(saved)} below the whole head's")

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
        if self.chunking:
            lines.append(f"chunked   {self._chunked()}: the step never holds the whole logits")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The plan as versioned JSON data, with the checksum of its content."""
        content = {
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
            "cost_model": self.cost_model,
            "device": self.device if isinstance(self.device, str) else asdict(self.device),
            "shared": [list(pair) for pair in self.shared],
            "compared": [list(c) for c in self.compared],
            "chunking": None if self.chunking is None else self.chunking.to_json(),
            "parallel": None if self.parallel is None else {
                "kind": type(self.parallel).__name__,
                **{k: _lists(v) for k, v in asdict(self.parallel).items()}},
        }
        return {**content, "checksum": checksum(content)}

    @classmethod
    def from_json(cls, data: Any) -> "Plan":
        """The plan `to_json` wrote; PlanFileError for anything else (another version, a
        plan changed after it was saved, a malformed one)."""
        _check_header(data)
        _check_fields(data)
        graph = _part("graph", Graph.from_json, data["graph"])
        schedule = _part("schedule", Schedule.from_json, data["schedule"])
        _check_against_graph(graph, schedule, data["shared"])
        return cls(graph=graph, schedule=schedule,
                   regions=tuple(Region.from_json(r) for r in data["regions"]),
                   shared=tuple((k, p) for k, p in data["shared"]),
                   mutated_buffers=tuple(data["mutated_buffers"]), parallel=_parallel_of(data["parallel"]),
                   compared=tuple((n, p, float(o)) for n, p, o in data["compared"]),
                   chunking=_chunking_of(data.get("chunking")), device=_device_of(data["device"]),
                   **{k: data[k] for k in _SCALARS})

    def save(self, path: str | Path) -> None:
        """Write the plan as versioned JSON (atomically: a reader never sees half a plan);
        an OSError naming `path` if it cannot be written."""
        write_atomically(Path(path), json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """The plan saved at `path`; PlanFileError naming the file when it holds no plan
        this optremat reads (OSError when it cannot be read at all)."""
        raw = Path(path).read_bytes()
        try:
            data = json.loads(raw)
        except ValueError as error:
            raise PlanFileError(f"plan file {path} is not valid JSON ({error}); plan again and save it") from None
        try:
            return cls.from_json(data)
        except PlanFileError as error:
            raise PlanFileError(f"plan file {path}: {error}") from None


def checksum(content: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a plan's content (every field but `checksum`)."""
    text = json.dumps({k: v for k, v in content.items() if k != "checksum"}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file renamed into place, so that a
    reader sees the old file or the new one, never half of one. On failure no temporary
    file is left and the OSError raised (of the same kind) names `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as error:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
        reason = (f"its directory {path.parent} does not exist" if not os.path.isdir(path.parent)
                  else error.strerror or str(error))
        raise type(error)(f"cannot write {path}: {reason}") from error


_SCALARS = ("model_fingerprint", "loss", "budget_bytes", "predicted_peak_bytes", "baseline_peak_bytes",
            "predicted_overhead", "solver", "status", "lower_bound", "solve_seconds", "solver_overhead",
            "training", "runtime", "cost_model")
"""The fields a plan file holds as they are: text, numbers and flags."""


def _device_of(data: str | dict) -> Any:
    """The device profile a plan was priced on: a built-in's name, or a `DeviceProfile`
    (one `measure_profile` measured) from its fields."""
    if isinstance(data, str):
        return data
    from optremat.tracing.costs import DeviceProfile
    try:
        return DeviceProfile(**data)
    except (TypeError, ValueError) as error:
        raise PlanFileError(f"device: not a device profile's fields ({error}); {_MALFORMED}") from None


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _is_count(value: Any) -> bool:
    """A whole number >= 0 (JSON's true and false are not numbers here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_bytes(value: Any) -> bool:
    return _is_count(value) and value > 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _list_of(item: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(item(v) for v in value)


def _row(*items: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """A list of exactly these items, in this order."""
    return lambda value: (isinstance(value, list) and len(value) == len(items)
                          and all(item(v) for item, v in zip(items, value)))


_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "format": (_is_text, "text"),
    "version": (_is_count, "a whole number"),
    "checksum": (_is_text, "text"),
    "graph": (lambda v: isinstance(v, dict), "an object (an optremat graph)"),
    "schedule": (lambda v: isinstance(v, dict), "an object (an optremat schedule)"),
    "regions": (_list_of(_row(_is_text, _is_count, _list_of(_row(_is_text, _is_count)))),
                "a list of [module path, call, [[op, occurrence], ...]]"),
    "model_fingerprint": (_is_text, "text"),
    "mutated_buffers": (_list_of(_is_text), "a list of buffer names"),
    "loss": (_is_text, "text"),
    "budget_bytes": (_is_bytes, "a whole number of bytes > 0"),
    "predicted_peak_bytes": (_is_bytes, "a whole number of bytes > 0"),
    "baseline_peak_bytes": (_is_bytes, "a whole number of bytes > 0"),
    "predicted_overhead": (_is_number, "a number"),
    "solver": (_is_text, "text"),
    "status": (_is_text, "text"),
    "lower_bound": (lambda v: v is None or _is_number(v), "a number or null"),
    "solve_seconds": (_is_number, "a number"),
    "solver_overhead": (_is_number, "a number"),
    "training": (_is_bool, "true or false"),
    "runtime": (lambda v: _is_text(v) and v in RUNTIMES, f"one of {', '.join(RUNTIMES)}"),
    "cost_model": (_is_text, "text"),
    "device": (lambda v: _is_text(v) or isinstance(v, dict), "a profile's name or its rates"),
    "shared": (_list_of(_row(_is_count, _is_count)), "a list of [event, input] pairs"),
    "compared": (_list_of(_row(_is_text, _is_count, _is_number)), "a list of [planner, peak bytes, overhead]"),
    "parallel": (lambda v: v is None or isinstance(v, dict), "null or an object"),
    "chunking": (lambda v: v is None or isinstance(v, dict), "null or an object"),
}
"""Every key of a plan file, what its value must be and how to say so."""

_ADDED = {6: ("chunking",)}
"""The keys each format version added, which files of earlier versions lack."""

_MALFORMED = "plan again to write a valid one"


def _check_header(data: Any) -> None:
    """Refuse JSON that is not a plan of a format this optremat reads, or whose content
    no longer matches the checksum it was saved with."""
    if not isinstance(data, dict):
        raise PlanFileError(f"a plan is one JSON object, not {_json_kind(data)}; {_MALFORMED}")
    if data.get("format") != "optremat.plan":
        found = "missing" if "format" not in data else f"{data['format']!r}"[:40]
        raise PlanFileError(f"not an optremat plan (format tag {found}, not 'optremat.plan')")
    if data.get("version") not in READS:
        raise PlanFileError(f"plan format version {data.get('version')} is not supported "
                            f"(this optremat reads {', '.join(map(str, READS))}); plan again")
    if not _is_text(data.get("checksum")):
        raise PlanFileError(f"the plan carries no checksum (key 'checksum'); {_MALFORMED}")
    try:
        matches = checksum(data) == data["checksum"]
    except (TypeError, ValueError):
        raise PlanFileError(f"the plan holds values that are not JSON data; {_MALFORMED}") from None
    if not matches:
        raise PlanFileError("the plan was changed after it was saved (its checksum does not match its content); "
                            "plan again")


def _check_fields(data: dict[str, Any]) -> None:
    """Refuse a plan with keys missing or unexpected, a value of the wrong type, or a
    region path whose span cannot be read."""
    expected = _FIELDS.keys() - {key for version, keys in _ADDED.items() if data["version"] < version for key in keys}
    missing, unexpected = expected - data.keys(), data.keys() - expected
    if missing:
        raise PlanFileError(f"the plan lacks the keys {sorted(missing)}; {_MALFORMED}")
    if unexpected:
        raise PlanFileError(f"the plan holds unexpected keys {sorted(unexpected)}; {_MALFORMED}")
    for key in expected:
        valid, shown = _FIELDS[key]
        if not valid(data[key]):
            raise PlanFileError(f"the plan's {key!r} must be {shown}, not {_json_kind(data[key])}; {_MALFORMED}")
    for path, _, _ in data["regions"]:
        if not _is_region_path(path):
            raise PlanFileError(f"region path {path!r} has a bad span: a run of a Sequential's children is written "
                                f"path[start:stop] with whole numbers start < stop; {_MALFORMED}")


def _is_region_path(path: str) -> bool:
    """Whether `path` names a module (`blocks.3`) or a span of a Sequential's children
    (`seq[0:3]`, start < stop), as `regions.parse_span` reads it."""
    match = re.fullmatch(r"[^\[\]]*(?:\[([0-9]+):([0-9]+)\])?", path)
    return match is not None and (match.group(1) is None or int(match.group(1)) < int(match.group(2)))


def _json_kind(value: Any) -> str:
    """What a JSON value is, for an error message: "a list", "the text 'abc'", "null"..."""
    if value is None:
        return "null"
    if isinstance(value, (bool, int, float)):
        return json.dumps(value)
    if isinstance(value, str):
        return f"the text {value[:40]!r}"
    return {dict: "an object", list: "a list"}.get(type(value), type(value).__name__)


def _part(name: str, read: Callable[[dict[str, Any]], Any], data: dict[str, Any]) -> Any:
    """A plan's graph or schedule read by `read`, its errors reported as PlanFileError."""
    try:
        return read(data)
    except (ValueError, TypeError, KeyError, IndexError) as error:
        raise PlanFileError(f"the plan's {name} is malformed ({error}); {_MALFORMED}") from None


def _check_against_graph(graph: Graph, schedule: Schedule, shared: list[list[int]]) -> None:
    """Refuse a schedule or `shared` pairs that do not fit the plan's graph: a schedule
    has one stage per node, and each pair names one of the schedule's events and a node
    (indices that `decisions`, `summary` and the runtimes look up)."""
    if schedule.num_stages != graph.n:
        raise PlanFileError(f"the plan's schedule 'num_stages' is {schedule.num_stages} for a graph of {graph.n} "
                            f"nodes (one stage per node); {_MALFORMED}")
    events = len(schedule.node)
    for event, node in shared:
        if event >= events or node >= graph.n:
            raise PlanFileError(f"the plan's 'shared' pair [{event}, {node}] names an event or node the plan lacks "
                                f"(its schedule has {events} events, its graph {graph.n} nodes); {_MALFORMED}")


_PARALLEL_FIELDS: dict[type | str, tuple[Callable[[Any], bool], str]] = {
    bool: (_is_bool, "true or false"), int: (_is_count, "a whole number >= 0"), float: (_is_number, "a number"),
    tuple: (_list_of(_is_text), "a list of text"), "groups": (_list_of(_list_of(_is_text)), "a list of lists of text"),
}
"""How a field of FSDP or DDP is checked, by its name or else by the type of its default."""


def _parallel_of(data: dict[str, Any] | None) -> Parallel | None:
    """The data-parallel job a plan file names, checked field by field against its type."""
    if data is None:
        return None
    kind = data.get("kind")
    if not _is_text(kind) or kind not in PARALLEL_KINDS:
        raise PlanFileError(f"the plan's parallel kind must be one of {', '.join(PARALLEL_KINDS)}, "
                            f"not {_json_kind(kind)}; {_MALFORMED}")
    defaults = {f.name: f.default for f in fields(PARALLEL_KINDS[kind])}
    given = {k: v for k, v in data.items() if k != "kind"}
    if kind == "FSDP":
        given.setdefault("groups", [])  # plans saved before FSDP had groups name none
    if given.keys() != defaults.keys():
        raise PlanFileError(f"the plan's parallel ({kind}) must have the keys {sorted(defaults)}, "
                            f"not {sorted(given)}; {_MALFORMED}")
    for name, value in given.items():
        valid, expected = _PARALLEL_FIELDS.get(name, _PARALLEL_FIELDS.get(type(defaults[name]), (_is_text, "text")))
        if not valid(value):
            raise PlanFileError(f"the plan's parallel {name!r} must be {expected}, not {_json_kind(value)}; "
                                f"{_MALFORMED}")
    return PARALLEL_KINDS[kind](**{k: _tuples(v) for k, v in given.items()})


def _lists(value: Any) -> Any:
    """A value with its tuples, nested ones too, as lists, as JSON holds them."""
    return [_lists(v) for v in value] if isinstance(value, tuple) else value


def _tuples(value: Any) -> Any:
    """A JSON value with its lists, nested ones too, as tuples."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


_CHUNKING_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "head": (_is_text, "text"),
    "chunks": (lambda v: v is None or _is_bytes(v), "null or a whole number >= 1"),
    "unplanned_peak_bytes": (_is_bytes, "a whole number of bytes > 0"),
    "tried": (_list_of(lambda v: v is None or _is_bytes(v)), "a list of chunk counts (null: whole)"),
}
"""Every key of a plan file's `chunking`, what its value must be and how to say so."""


def _chunking_of(data: dict[str, Any] | None) -> Chunking | None:
    """The LM head chunking a plan file records, checked field by field."""
    if data is None:
        return None
    if data.keys() != _CHUNKING_FIELDS.keys():
        raise PlanFileError(f"the plan's chunking must have the keys {sorted(_CHUNKING_FIELDS)}, not {sorted(data)}; "
                            f"{_MALFORMED}")
    for key, (valid, shown) in _CHUNKING_FIELDS.items():
        if not valid(data[key]):
            raise PlanFileError(f"the plan's chunking {key!r} must be {shown}, not {_json_kind(data[key])}; "
                                f"{_MALFORMED}")
    return Chunking(data["head"], data["chunks"], data["unplanned_peak_bytes"], tuple(data["tried"]))


def loss_note(loss_fn: Callable | None, source: str = "assumed", head_chunks: int | None = None) -> str:
    """How a native plan priced the loss (`Plan.loss`): given as `loss_fn`, the model's own
    (`source` "own"; with its LM head and loss in `head_chunks` token chunks, if given),
    or assumed after the model."""
    held = "; the model's output priced as held through the backward (as `out = model(x)` holds it)"
    if loss_fn is not None:
        return f"priced as part of the step (loss_fn){held}"
    if source == "own":
        chunked = "" if head_chunks is None else (
            f"; its LM head and loss run in {head_chunks} token chunks, so the logits it returns are None "
            "(outputs.logits, or an output tuple's) unless its forward reads them otherwise too")
        return (f"the model's own (outputs.loss, or the scalar a loss function made from another tensor of its "
                f"output tuple: computed by the model from its inputs' labels or targets){chunked}{held}")
    return ("not given: priced as a cross-entropy over the last dimension of the largest output after the "
            "model (an output of 3+ dimensions as a causal LM's: shifted one position, flattened and cast to "
            f"float32, each a copy){held}; pass loss_fn to price another")
