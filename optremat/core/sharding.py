"""What one rank of a data-parallel job holds, as a Graph: FSDP2 (`fully_shard`) and DDP.

The budget of a data-parallel job is per rank, and a rank holds more than its share of
the model's tensors: `per_rank` rewrites a traced step so that `simulate` prices one rank.

FSDP2, with `fully_shard` applied to each module of `units`, to each of `groups` (modules
sharded together as one unit, as accelerate shards a model's final norm and LM head) and
then to the model (the root, whose parameters stay gathered from its forward to the end
of its backward):

- each parameter keeps its shard: dim 0 cut in `world` rows of ceil(dim0 / world), so
  every rank holds the padded shard; buffers are not sharded;
- a unit's gathered parameters are held from its first forward op to its last (or,
  without `reshard_after_forward`, and always for a group, to the end of its backward),
  and again in the backward from the moment the unit after it in forward order starts its backward (FSDP2
  prefetches one unit ahead; the root starts when the first backward op inside the model
  runs, after the loss's backward) to the unit's last backward op; gathering needs a flat
  buffer of the padded size beside them;
- autograd writes each gradient at full size; it stays until the unit's last backward op,
  when a flat reduce-scatter input of the padded size takes it in and the gradient's
  shard remains. FSDP2 keeps that input alive until the next unit's reduce-scatter.

DDP keeps full parameters and gradients and a second copy of every gradient in its
communication buckets, allocated when the model is wrapped.

Both hold `optimizer_state` bytes per parameter byte of their (sharded) parameters.
The held bytes land in `Graph.held` per stage; recomputation never gathers again,
because plans for FSDP keep every region inside one unit (`unit_of`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

import numpy as np

from optremat.core.graph import Graph


@dataclass(frozen=True)
class FSDP:
    """FSDP2: `fully_shard` on each module matching `units` (module paths; `*` matches one
    path component, as in "layers.*"), on each of `groups` (the modules matching its
    paths taken together as one unit, `fully_shard([norm, lm_head])`, kept gathered from
    its forward through its backward), then on the model, over `world` ranks (0: the
    size of the process group the plan is made in)."""

    units: tuple[str, ...] = ()
    world: int = 0
    reshard_after_forward: bool = True
    optimizer_state: float = 0.0
    groups: tuple[tuple[str, ...], ...] = ()

    def describe(self) -> str:
        units = ",".join(self.units) or "the model only"
        groups = "".join(f", group {'+'.join(group)}" for group in self.groups)
        return (f"FSDP2 over {self.world} ranks, units {units}{groups}, reshard after forward "
                f"{'on' if self.reshard_after_forward else 'off'}, optimizer state x{self.optimizer_state:g}")


@dataclass(frozen=True)
class DDP:
    """DistributedDataParallel over `world` ranks (0: the process group's size), with its
    default gradient buckets (a copy of the gradients, not views of them)."""

    world: int = 0
    optimizer_state: float = 0.0

    def describe(self) -> str:
        return f"DDP over {self.world} ranks, optimizer state x{self.optimizer_state:g}"


Parallel = FSDP | DDP

ROOT = 0
"""The root unit's index in `unit_of`: the model itself, gathered for the whole step."""


def per_rank(graph: Graph, parameters: Sequence[tuple[int, int]], parallel: Parallel) -> Graph:
    """`graph` as one rank of `parallel` holds it; `parameters` lists (parameter node,
    node holding its gradient or -1) for every parameter (buffers are not in it)."""
    if parallel.world < 1:
        raise ValueError(f"{type(parallel).__name__}.world must be at least 1, not {parallel.world}")
    if isinstance(parallel, DDP):
        params = [p for p, _ in parameters]
        buckets = sum(int(graph.size[p]) for p, g in parameters if g >= 0)
        state = int(parallel.optimizer_state * graph.size[params].sum())
        return replace(graph, held=_frozen(graph.held + buckets + state))
    return _fsdp(graph, parameters, parallel)


def matcher(units: Sequence[str]) -> Callable[[str], bool]:
    """Whether a module path matches one of the `units` patterns (`*`: one path component)."""
    patterns = [re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in unit.split(".")) + "$")
                for unit in units]
    return lambda path: any(p.match(path) for p in patterns)


def check_matched(name: str, paths: Iterable[str], patterns: Sequence[str]) -> None:
    """A ValueError naming the patterns of `patterns` (FSDP units) that no module path of
    `paths` (in the model `name`) matches: a unit that matches nothing shards nothing."""
    paths = list(paths)
    missing = [pattern for pattern in patterns if not any(map(matcher([pattern]), paths))]
    if missing:
        raise ValueError(f"no module of {name} matches the FSDP units {missing} (module paths, '*' matching one path "
                         "component, as in 'layers.*')")


def unit_of(graph: Graph, units: Sequence[str], groups: Sequence[Sequence[str]] = ()) -> np.ndarray:
    """Per node, the FSDP unit that runs it: ROOT (0) for the root, else 1 + the index (in order
    of first appearance) of the innermost module matching a pattern of `units` or of one
    of `groups` (all of a group's modules are one unit) among the node's module and the
    modules enclosing it."""
    return _units(graph, units, groups)[0]


def _units(graph: Graph, units: Sequence[str], groups: Sequence[Sequence[str]]) -> tuple[np.ndarray, set[int]]:
    """`unit_of`, and which of its units are groups."""
    is_unit = matcher(units)
    in_group = [matcher(group) for group in groups]

    def unit_key(path: str) -> str | None:
        if is_unit(path):
            return path
        return next((f"group {k}" for k, member in enumerate(in_group) if member(path)), None)

    ids: dict[str, int] = {"": 0}
    found: dict[str, int] = {}
    out = np.empty(graph.n, dtype=np.int64)
    for i, module in enumerate(graph.module):
        if module not in found:
            parts = module.split(".") if module else []
            key = next((k for k in (unit_key(".".join(parts[:d])) for d in range(len(parts), 0, -1)) if k), "")
            found[module] = ids.setdefault(key, len(ids))
        out[i] = found[module]
    return out, {unit for key, unit in ids.items() if key.startswith("group ")}


def shard_bytes(graph: Graph, node: int, world: int) -> int:
    """Bytes of one rank's padded shard of a parameter: ceil(dim0 / world) rows."""
    size = int(graph.size[node])
    shape = re.fullmatch(r"[a-z0-9]+\[([0-9, ]*)\]", graph.tensor[node]) if graph.tensor else None
    dims = [int(d) for d in shape.group(1).split(",") if d.strip()] if shape else []
    if not dims or dims[0] == 0:
        return math.ceil(size / world)
    return math.ceil(dims[0] / world) * (size // dims[0])


def _fsdp(graph: Graph, parameters: Sequence[tuple[int, int]], parallel: FSDP) -> Graph:
    n = graph.n
    unit, grouped = _units(graph, parallel.units, parallel.groups)
    stages = np.arange(n)
    ops = ~graph.pinned
    forward_of = {u: stages[ops & ~graph.backward & (unit == u)] for u in set(unit[ops].tolist())}
    backward_of = {u: stages[graph.backward & (unit == u)] for u in set(unit[ops].tolist())}
    reduced = {u: n - 1 if u == ROOT else _last(backward_of[u], n - 1) for u in backward_of}
    size, held = graph.size.copy(), graph.held.astype(np.int64).copy()
    gathered = np.zeros(int(unit.max()) + 1, dtype=np.int64)
    flat = np.zeros_like(gathered)
    for p, g in parameters:
        u, shard = int(unit[p]), shard_bytes(graph, p, parallel.world)
        gathered[u] += int(graph.size[p])
        flat[u] += shard * parallel.world
        size[p] = shard
        held += int(parallel.optimizer_state * shard)
        if g >= 0:
            _shrink_gradient(graph, size, held, g, shard, reduced.get(u, n - 1))
    in_model = graph.backward & np.array([bool(m) for m in graph.module])
    root_backward = _first(stages[in_model] if in_model.any() else stages[graph.backward], n)
    held += gathered[ROOT]
    held[_first(stages[ops], 0)] += flat[ROOT]
    order = sorted((u for u in forward_of if u != ROOT and len(forward_of[u])), key=lambda u: forward_of[u][-1])
    for u, after in zip(order, order[1:] + [ROOT]):
        f0, f1 = int(forward_of[u][0]), int(forward_of[u][-1])
        b0 = root_backward if after == ROOT else _first(backward_of.get(after), root_backward)
        b1 = _last(backward_of.get(u), b0)
        reshard = parallel.reshard_after_forward and u not in grouped
        held[f0:(f1 if reshard else b1) + 1] += gathered[u]
        held[f0] += flat[u]
        if reshard:
            held[b0:b1 + 1] += gathered[u]
            held[b0] += flat[u]
    _reduce_scatter_inputs(held, [(reduced.get(u, n - 1), int(flat[u])) for u in order + [ROOT]])
    return replace(graph, size=_frozen(size), held=_frozen(held))


def _shrink_gradient(graph: Graph, size: np.ndarray, held: np.ndarray, g: int, shard: int, reduced: int) -> None:
    """A gradient stored at its shard's size from the op that writes it, the rest held
    until its unit's reduce-scatter (stage `reduced`)."""
    owner = int(graph.storage_root[g])
    part_of = int(graph.alias_of[owner]) if graph.is_part[owner] else -1
    full = int(graph.unit_size[owner]) if part_of < 0 else int(graph.size[owner])
    if graph.pinned[owner] or full <= shard or graph.units[owner] != (owner,):
        return
    size[owner] -= full - shard
    if part_of >= 0:
        size[part_of] -= full - shard
    held[owner:max(owner, reduced) + 1] += full - shard


def _reduce_scatter_inputs(held: np.ndarray, reductions: list[tuple[int, int]]) -> None:
    """Each unit's flat reduce-scatter input (stage of its unit's last backward op, bytes):
    at that op the previous unit's input is still held and then gives way to this one,
    which stays until the next unit's reduce-scatter (the last one to the step's end)."""
    reductions = sorted(reductions)
    for k, (stage, nbytes) in enumerate(reductions):
        previous = reductions[k - 1][1] if k else 0
        end = reductions[k + 1][0] if k + 1 < len(reductions) else len(held)
        held[stage] += max(nbytes, previous)
        held[stage + 1:end] += nbytes


def _first(stages: np.ndarray | None, default: int) -> int:
    return int(stages[0]) if stages is not None and len(stages) else default


def _last(stages: np.ndarray | None, default: int) -> int:
    return int(stages[-1]) if stages is not None and len(stages) else default


def _frozen(array: np.ndarray) -> np.ndarray:
    out = np.asarray(array, dtype=np.int64).copy()
    out.setflags(write=False)
    return out
