"""The Graph IR: one training step (forward + backward) as an immutable DAG.

Nodes are numbered in a topological order (every edge goes from a lower to a higher
index), which is also the order the unplanned step runs them in. Planners, the
simulator and the runtime all read this one type; it holds no torch objects, so solver
tests build graphs from plain lists.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

import networkx as nx
import numpy as np

FORMAT_VERSION = 1

KINDS = ("op", "param", "input")
"""`param` and `input` nodes are sources, numbered first, resident for the whole step."""


class GraphError(ValueError):
    """A graph that breaks the IR's invariants (order, sizes, aliases)."""


def _frozen(values: Any, dtype: Any) -> np.ndarray:
    array = np.array(values, dtype=dtype)
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class Graph:
    """A joint forward+backward graph.

    `cost` is seconds per node, `size` bytes of the node's own output storage,
    `workspace` bytes of temporaries the op allocates and frees while it runs, `held`
    bytes the runtime holds outside the graph's tensors while the node's stage runs (a
    data-parallel runtime's gathered parameters and unreduced gradients), `lives_to` the
    last node the eager step runs while it still holds the node's output whether or not
    anything reads it (-1: none; Python holds a module call's arguments until the call
    returns, a backward formula its temporaries until it returns). An alias
    (`alias_of` >= 0: a view, an in-place result, `detach`) of size 0 holds its base's
    storage; an alias of size > 0 is a *part*: one output of a multi-output op (its base),
    holding only its own bytes of the base's storage, so each output of such an op can
    die on its own. `output` marks tensors that must survive to the end of the step
    (loss, parameter gradients).
    """

    names: tuple[str, ...]
    ops: tuple[str, ...]
    cost: np.ndarray
    size: np.ndarray
    backward: np.ndarray
    kind: tuple[str, ...]
    module: tuple[str, ...]
    alias_of: np.ndarray
    output: np.ndarray
    edges: np.ndarray
    fusible: np.ndarray
    workspace: np.ndarray
    tensor: tuple[str, ...] = field(default=())
    held: np.ndarray = field(default=None)
    lives_to: np.ndarray = field(default=None)

    def __post_init__(self) -> None:
        if self.held is None:
            object.__setattr__(self, "held", _frozen(np.zeros(len(self.cost)), np.int64))
        if self.lives_to is None:
            object.__setattr__(self, "lives_to", _frozen(np.full(len(self.cost), -1), np.int64))

    @classmethod
    def build(
        cls,
        *,
        cost: Sequence[float],
        size: Sequence[int],
        edges: Iterable[tuple[int, int]],
        backward: Sequence[bool] | None = None,
        names: Sequence[str] | None = None,
        ops: Sequence[str] | None = None,
        kind: Sequence[str] | None = None,
        module: Sequence[str] | None = None,
        alias_of: Sequence[int] | None = None,
        output: Sequence[bool] | None = None,
        fusible: Sequence[bool] | None = None,
        workspace: Sequence[int] | None = None,
        tensor: Sequence[str] | None = None,
        held: Sequence[int] | None = None,
        lives_to: Sequence[int] | None = None,
    ) -> "Graph":
        """Build and validate a graph from plain lists; omitted columns get defaults."""
        n = len(cost)
        edge_array = np.array(sorted(set(map(tuple, edges))), dtype=np.int64).reshape(-1, 2)
        graph = cls(
            names=tuple(names) if names is not None else tuple(f"n{i}" for i in range(n)),
            ops=tuple(ops) if ops is not None else ("op",) * n,
            cost=_frozen(cost, np.float64),
            size=_frozen(size, np.int64),
            backward=_frozen(backward if backward is not None else [False] * n, bool),
            kind=tuple(kind) if kind is not None else ("op",) * n,
            module=tuple(module) if module is not None else ("",) * n,
            alias_of=_frozen(alias_of if alias_of is not None else [-1] * n, np.int64),
            output=_frozen(output if output is not None else [False] * n, bool),
            edges=_frozen(edge_array, np.int64),
            fusible=_frozen(fusible if fusible is not None else [False] * n, bool),
            workspace=_frozen(workspace if workspace is not None else [0] * n, np.int64),
            tensor=tuple(tensor) if tensor is not None else ("",) * n,
            held=_frozen(held if held is not None else [0] * n, np.int64),
            lives_to=_frozen(lives_to if lives_to is not None else [-1] * n, np.int64),
        )
        graph._validate()
        return graph

    def _validate(self) -> None:
        n = self.n
        for name in ("names", "ops", "kind", "module", "tensor"):
            if len(getattr(self, name)) != n:
                raise GraphError(f"column {name!r} has {len(getattr(self, name))} entries for {n} nodes")
        for name in ("size", "backward", "alias_of", "output", "fusible", "workspace", "held", "lives_to"):
            if getattr(self, name).shape != (n,):
                raise GraphError(f"column {name!r} has shape {getattr(self, name).shape} for {n} nodes")
        if np.any(~np.isfinite(self.cost)) or np.any(self.cost < 0):
            raise GraphError("costs must be finite and >= 0")
        if np.any(self.size < 0) or np.any(self.workspace < 0) or np.any(self.held < 0):
            raise GraphError("sizes, workspaces and held bytes must be >= 0")
        if np.any(self.lives_to < -1) or np.any(self.lives_to >= n):
            raise GraphError("lives_to must name a node of the graph, or be -1")
        bad_kind = set(self.kind) - set(KINDS)
        if bad_kind:
            raise GraphError(f"unknown node kinds {sorted(bad_kind)}; expected one of {KINDS}")
        if len(self.edges):
            src, dst = self.edges[:, 0], self.edges[:, 1]
            if src.min() < 0 or dst.max() >= n:
                raise GraphError("an edge names a node that does not exist")
            back = np.nonzero(src >= dst)[0]
            if len(back):
                s, d = self.edges[back[0]]
                raise GraphError(f"edge {s}->{d} is not in topological order (nodes must be numbered so edges go forward)")
            sources = set(dst[np.isin(dst, np.nonzero(self.pinned)[0])].tolist())
            if sources:
                raise GraphError(f"param/input node {min(sources)} has a predecessor; they must be sources")
        first_op = int(np.argmin(self.pinned)) if not self.pinned.all() else n
        if self.pinned[first_op:].any():
            raise GraphError("param/input nodes must come before every op node")
        for i in np.nonzero(self.alias_of >= 0)[0]:
            base = int(self.alias_of[i])
            if base >= i:
                raise GraphError(f"node {i} aliases node {base}, which does not come before it")
            if base not in self.preds[i]:
                raise GraphError(f"node {i} aliases node {base} but does not read it")
            if self.size[i] > 0 and self.alias_of[base] >= 0:
                raise GraphError(f"node {i} is a part of node {base}, which is itself an alias")
        parts = np.bincount(self.alias_of[self.is_part], weights=self.size[self.is_part], minlength=n)
        over = np.nonzero(parts > self.size)[0]
        if len(over):
            raise GraphError(f"the parts of node {over[0]} are larger than the node")

    @property
    def n(self) -> int:
        return len(self.cost)

    @cached_property
    def pinned(self) -> np.ndarray:
        """Nodes resident for the whole step: parameters and inputs."""
        return _frozen([k != "op" for k in self.kind], bool)

    @cached_property
    def preds(self) -> tuple[np.ndarray, ...]:
        return self._adjacency(1, 0)

    def ancestors(self, targets: Iterable[int], through: np.ndarray) -> list[int]:
        """`targets` and every node they depend on through nodes marked in `through`, sorted."""
        seen = set(targets)
        stack = list(seen)
        while stack:
            for p in self.preds[stack.pop()].tolist():
                if p not in seen and through[p]:
                    seen.add(p)
                    stack.append(p)
        return sorted(seen)

    @cached_property
    def succs(self) -> tuple[np.ndarray, ...]:
        return self._adjacency(0, 1)

    @cached_property
    def pred_lists(self) -> tuple[tuple[int, ...], ...]:
        """`preds` as Python ints, for the simulator's per-node loops."""
        return tuple(tuple(p.tolist()) for p in self.preds)

    def _adjacency(self, key: int, value: int) -> tuple[np.ndarray, ...]:
        lists: list[list[int]] = [[] for _ in range(self.n)]
        for edge in self.edges:
            lists[int(edge[key])].append(int(edge[value]))
        return tuple(_frozen(sorted(x), np.int64) for x in lists)

    @cached_property
    def is_part(self) -> np.ndarray:
        """Aliases that own a part of their base's storage (one output of a multi-output op)."""
        return _frozen((self.alias_of >= 0) & (self.size > 0), bool)

    @cached_property
    def units(self) -> tuple[tuple[int, ...], ...]:
        """The storage units each node keeps alive while it is live.

        A unit is named by the node that owns it: a part owns its bytes, a multi-output op
        owns what its parts do not cover, an ordinary node owns its whole output. Memory is
        the total `unit_size` of the units held by at least one live node.
        """
        parts: list[list[int]] = [[] for _ in range(self.n)]
        for i in np.nonzero(self.is_part)[0].tolist():
            parts[int(self.alias_of[i])].append(i)
        units: list[tuple[int, ...]] = []
        for i in range(self.n):
            if self.is_part[i]:
                units.append((i,))
            elif self.alias_of[i] >= 0:
                units.append(units[int(self.alias_of[i])])
            else:
                own = (i,) if self.unit_size[i] > 0 or not parts[i] else ()
                units.append(tuple(parts[i]) + own)
        return tuple(units)

    @cached_property
    def unit_size(self) -> np.ndarray:
        """Bytes owned by each unit (see `units`); 0 for plain aliases."""
        sizes = np.where(self.alias_of >= 0, 0, self.size).astype(np.int64)
        sizes[self.is_part] = self.size[self.is_part]
        covered = np.bincount(self.alias_of[self.is_part], weights=self.size[self.is_part], minlength=self.n)
        sizes -= covered.astype(np.int64)
        return _frozen(sizes, np.int64)

    @cached_property
    def storage_root(self) -> np.ndarray:
        """The node owning each node's storage: itself, or for a view its base's owner (a
        part owns its own bytes)."""
        root = np.arange(self.n)
        for v in np.nonzero((self.alias_of >= 0) & ~self.is_part)[0].tolist():
            root[v] = root[self.alias_of[v]]
        return _frozen(root, np.int64)

    @cached_property
    def shareable(self) -> np.ndarray:
        """For each node, the input whose storage its output may take over (-1 for none).

        Only a pointwise op qualifies, and only for an input of its output's type and shape
        whose storage is exactly the output's size (one output of a multi-output op
        qualifies, a storage shared by several does not), that the op reads through no other view, and that is not a parameter, input or
        output of the step. Graphs without tensor types share nothing."""
        share = np.full(self.n, -1, dtype=np.int64)
        if len(self.tensor) != self.n:
            return _frozen(share, np.int64)
        root = self.storage_root
        fixed = self.pinned | self.output
        for v in np.nonzero(self.fusible & (self.alias_of < 0) & (self.size > 0))[0].tolist():
            if "]," in self.tensor[v] or self.units[v] != (v,):
                continue
            preds = self.preds[v].tolist()
            for p in preds:
                r = int(root[p])
                if (self.tensor[p] == self.tensor[v] and self.size[r] == self.size[v] and self.unit_size[r] == self.size[r]
                        and self.units[r] == (r,) and not fixed[r]
                        and all(root[q] != r for q in preds if q != p)):
                    share[v] = p
                    break
        return _frozen(share, np.int64)

    @cached_property
    def held_until(self) -> np.ndarray:
        """Per node, the stage its first computation lives into at least in the eager step
        (a schedule's `until`): the one after `lives_to`, at whose start it is freed
        unless that stage reads it; the node itself where nothing holds it."""
        hold = np.where(self.lives_to >= 0, np.minimum(self.lives_to + 1, self.n - 1), -1)
        return _frozen(np.maximum(hold, np.arange(self.n)), np.int64)

    @cached_property
    def pinned_bytes(self) -> int:
        return int(self.size[self.pinned].sum())

    @cached_property
    def total_cost(self) -> float:
        """Cost of the unplanned step: every node once."""
        return float(self.cost.sum())

    def with_node(self, at: int, *, name: str, op: str, kind: str, size: int, backward: bool, output: bool,
                  cost: float = 0.0, workspace: int = 0, reads: Sequence[int] = (),
                  feeds: Sequence[int] = ()) -> "Graph":
        """This graph with a node inserted at index `at`, reading the nodes `reads` and
        read by `feeds` (indices before the insertion); it holds nothing beyond its own
        output and workspace."""
        def shifted(i: int) -> int:
            return i + (i >= at) if i >= 0 else i

        def column(values: Iterable[Any], value: Any) -> list:
            out = list(values)
            out.insert(at, value)
            return out

        edges = ([(shifted(a), shifted(b)) for a, b in self.edges.tolist()]
                 + [(shifted(r), at) for r in reads] + [(at, shifted(f)) for f in feeds])
        return Graph.build(names=column(self.names, name), ops=column(self.ops, op), cost=column(self.cost, cost),
                           size=column(self.size, size), backward=column(self.backward, backward),
                           kind=column(self.kind, kind), module=column(self.module, ""),
                           alias_of=column(map(shifted, self.alias_of.tolist()), -1),
                           output=column(self.output, output), edges=edges, fusible=column(self.fusible, False),
                           workspace=column(self.workspace, workspace),
                           tensor=column(self.tensor, "") if self.tensor else None, held=column(self.held, 0),
                           lives_to=column(map(shifted, self.lives_to.tolist()), -1))

    def to_networkx(self) -> nx.DiGraph:
        """A networkx view for algorithms; node attributes mirror the columns."""
        g = nx.DiGraph()
        for i in range(self.n):
            g.add_node(i, name=self.names[i], op=self.ops[i], cost=float(self.cost[i]),
                       size=int(self.size[i]), backward=bool(self.backward[i]), kind=self.kind[i],
                       module=self.module[i])
        g.add_edges_from(map(tuple, self.edges.tolist()))
        return g

    @cached_property
    def fingerprint(self) -> str:
        """A hash of the graph's structure (ops, tensor types, sizes, edges), not of costs."""
        digest = hashlib.sha256()
        for column in (self.ops, self.kind, self.tensor):
            digest.update("\x1f".join(column).encode())
        for array in (self.size, self.workspace, self.alias_of, self.output, self.backward, self.edges,
                      *([self.held] if self.held.any() else []),
                      *([self.lives_to] if (self.lives_to >= 0).any() else [])):
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()[:16]

    def summary(self) -> str:
        """A few lines a person reads: node counts, bytes, cost."""
        fwd = int((~self.backward & ~self.pinned).sum())
        bwd = int(self.backward.sum())
        lines = [
            f"{self.n} nodes ({fwd} forward, {bwd} backward, {int(self.pinned.sum())} params/inputs), {len(self.edges)} edges",
            f"params+inputs {format_bytes(self.pinned_bytes)}, activations+grads {format_bytes(int(self.size[~self.pinned].sum()))}",
            f"step cost {self.total_cost * 1e3:.3f} ms",
        ]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": "optremat.graph",
            "version": FORMAT_VERSION,
            "names": list(self.names),
            "ops": list(self.ops),
            "cost": self.cost.tolist(),
            "size": self.size.tolist(),
            "backward": self.backward.tolist(),
            "kind": list(self.kind),
            "module": list(self.module),
            "alias_of": self.alias_of.tolist(),
            "output": self.output.tolist(),
            "edges": self.edges.tolist(),
            "fusible": self.fusible.tolist(),
            "workspace": self.workspace.tolist(),
            "tensor": list(self.tensor),
            "held": self.held.tolist(),
            "lives_to": self.lives_to.tolist(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Graph":
        if data.get("format") != "optremat.graph":
            raise GraphError("not an optremat graph (missing format tag); optremat.core.published.load reads published node-link graphs")
        if data.get("version") != FORMAT_VERSION:
            raise GraphError(f"graph format version {data.get('version')} is not supported (this optremat reads {FORMAT_VERSION})")
        columns = {k: v for k, v in data.items() if k not in ("format", "version")}
        try:
            return cls.build(**columns)
        except (TypeError, ValueError, OverflowError) as error:
            raise GraphError(f"malformed graph columns: {error}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @classmethod
    def load(cls, path: str | Path) -> "Graph":
        """Load an optremat graph file (`optremat.core.published.load` also reads the published
        node-link graphs)."""
        return cls.from_json(json.loads(Path(path).read_text()))


def writes_in_place(op: str) -> bool:
    """Whether an op of a Graph (its name as `Graph.ops` holds it, "add_.Tensor") writes
    over a tensor it is given: an in-place op, or an `out=` overload ("add.out")."""
    name, _, overload = op.partition(".")
    return name.endswith("_") or overload == "out" or overload.endswith("_out")


def format_bytes(n: float) -> str:
    """Bytes in binary units, e.g. 1.50 GiB."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    step = 0
    while abs(n) >= 1024 and step < len(units) - 1:
        n /= 1024
        step += 1
    return f"{n:.0f} B" if step == 0 else f"{n:.2f} {units[step]}"
