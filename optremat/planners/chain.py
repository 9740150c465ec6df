"""The chain of repeated blocks in a traced step, and the timeline it cuts the step into.

A transformer runs the same block many times: the same ops on tensors of the same
shapes. Each block's forward is a run of consecutive stages, and so is its backward, in
reverse block order; between them lie the gaps (the embedding before the first block,
the head and loss between the forwards and the backwards, the embedding's backward
after). A plan of regions inside the blocks changes the memory of the timeline block by
block: inside a block's own forward and backward, and, by what the block then holds, in
every segment it spans. `Chain` names those segments and, per segment, how it stands to
a given block (`relation`), so that what one block's plan does to a segment is measured
once and read for every block. No torch here.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from optremat.planners.regions import Call, Region, RegionMap

FORWARD, BACKWARD = "forward", "backward"
AFTER_FORWARD, AFTER_BACKWARD = "after forward", "after backward"
BEFORE, MIDDLE, END = "before", "middle", "end"


@dataclass(frozen=True)
class Segment:
    """Stages `first`..`last` of the step: a block's forward or backward, the gap after a
    block's forward or backward (`block` that block), or one of the gaps before the
    blocks, between their forwards and backwards, and after them (`block` -1)."""

    kind: str
    block: int
    first: int
    last: int


@dataclass(frozen=True, eq=False)
class Chain:
    """Repeated calls that run the same ops on the same shapes (`blocks`, in run order),
    with the candidate regions inside each (`inner[k]`, aligned across blocks: the i-th
    of every block is the same module of it) and the step's timeline as `segments`."""

    rmap: RegionMap
    blocks: tuple[Call, ...]
    inner: tuple[tuple[Call, ...], ...]
    segments: tuple[Segment, ...]

    def relation(self, segment: Segment, block: int) -> tuple[str, int]:
        """How `segment` stands to `block`: its kind and whether the segment's block comes
        before (-1), is (0) or comes after (1) it; gaps outside the blocks stand alike to all."""
        if segment.block < 0:
            return segment.kind, 0
        return segment.kind, int(np.sign(segment.block - block))

    def moved(self, regions: tuple[Region, ...], source: int, target: int) -> tuple[Region, ...]:
        """Regions inside block `source` as the same modules of block `target`."""
        where = {call: i for i, call in enumerate(self.inner[source])}
        return tuple(Region(*self.inner[target][where[(r.path, r.call)]], r.saved) for r in regions)


COVERAGE = 0.5
"""The least share of the step's forward compute (seconds; ops where none is priced) a
chain's blocks must run: a chain of layer norms is no skeleton to plan a model by, and a
head run in 128 token chunks, many small ops, takes no chain of decoder layers away."""


def chain_of(rmap: RegionMap, least: int = 3) -> Chain | None:
    """The chain of at least `least` identical blocks, among the module calls of one
    depth, running the most forward compute (at least COVERAGE of the step's), whose
    forwards and backwards each run as consecutive stages; None if there is none."""
    best, weights = None, _weights(rmap)
    for structure in rmap.structures():
        groups: dict[tuple, list[Call]] = defaultdict(list)
        for call in structure:
            groups[_signature(rmap, call)].append(call)
        for calls in groups.values():
            if len(calls) >= least and (best is None or
                                        _coverage(rmap, weights, calls) > _coverage(rmap, weights, best.blocks)):
                found = _chain(rmap, tuple(calls))
                best = found or best
    graph = rmap.graph
    forward = weights[~graph.backward & ~graph.pinned].sum()
    return best if best is not None and _coverage(rmap, weights, best.blocks) >= COVERAGE * forward else None


def _weights(rmap: RegionMap) -> np.ndarray:
    """What an op weighs in a chain's coverage: its cost, or 1 where the step has none."""
    graph = rmap.graph
    return graph.cost if graph.cost[~graph.backward].sum() > 0 else np.ones(graph.n)


def _coverage(rmap: RegionMap, weights: np.ndarray, calls: tuple[Call, ...] | list[Call]) -> float:
    return float(sum(weights[rmap.members[call]].sum() for call in calls))


def _signature(rmap: RegionMap, call: Call) -> tuple:
    """What makes two calls the same block: their ops, sizes and costs, in run order."""
    graph, members = rmap.graph, rmap.members[call]
    return (tuple(graph.ops[v] for v in members.tolist()), graph.size[members].tobytes(),
            graph.cost[members].tobytes())


def _chain(rmap: RegionMap, blocks: tuple[Call, ...]) -> Chain | None:
    """The chain of `blocks` if their forwards and backwards run as consecutive stages in
    order (forwards first to last, backwards last to first), each backward the same ops
    on the same sizes, and their candidates align; else None."""
    graph = rmap.graph
    owner = np.full(graph.n, -1, dtype=np.int64)
    for k, call in enumerate(blocks):
        owner[rmap.members[call]] = k
    grad = np.where(rmap.grad_of >= 0, owner[np.maximum(rmap.grad_of, 0)], -1)
    phase = np.where(graph.backward, grad, owner)
    forwards, backwards = [], []
    for k in range(len(blocks)):
        forward = np.nonzero(owner == k)[0]
        backward = np.nonzero(graph.backward & (phase == k))[0]
        if not len(backward) or forward[-1] - forward[0] + 1 != len(forward):
            return None
        first, last = int(backward[0]), int(backward[-1])
        if np.any((phase[first:last + 1] != k) & (phase[first:last + 1] != -1)):
            return None
        forwards.append((int(forward[0]), int(forward[-1])))
        backwards.append((first, last))
    if not (_ascending(forwards) and _ascending(backwards[::-1]) and forwards[-1][1] < backwards[-1][0]):
        return None
    shapes = {(tuple(graph.ops[v] for v in range(a, b + 1)), graph.size[a:b + 1].tobytes(),
               graph.cost[a:b + 1].tobytes()) for a, b in backwards}
    inner = _aligned(rmap, blocks)
    if len(shapes) != 1 or inner is None:
        return None
    return Chain(rmap, blocks, inner, _segments(graph.n, forwards, backwards))


def _ascending(spans: list[tuple[int, int]]) -> bool:
    return all(a[1] < b[0] for a, b in zip(spans, spans[1:]))


def _aligned(rmap: RegionMap, blocks: tuple[Call, ...]) -> tuple[tuple[Call, ...], ...] | None:
    """Per block, the candidate calls inside it, ordered by where their ops sit in the
    block, so that the i-th of every block is the same module; None if they differ."""
    candidates = rmap.candidates()
    inner, layouts = [], set()
    for block in blocks:
        start, members = int(rmap.members[block][0]), set(rmap.members[block].tolist())
        calls = [c for c in candidates if set(rmap.members[c].tolist()) <= members]
        calls.sort(key=lambda c: (tuple((rmap.members[c] - start).tolist()), c[0]))
        inner.append(tuple(calls))
        layouts.add(tuple(tuple((rmap.members[c] - start).tolist()) for c in calls))
    return tuple(inner) if len(layouts) == 1 else None


def _segments(n: int, forwards: list[tuple[int, int]], backwards: list[tuple[int, int]]) -> tuple[Segment, ...]:
    """The step's stages cut at the blocks' forwards and backwards (empty gaps left out)."""
    found = [Segment(BEFORE, -1, 0, forwards[0][0] - 1)]
    for k, (first, last) in enumerate(forwards):
        found.append(Segment(FORWARD, k, first, last))
        following = forwards[k + 1][0] if k + 1 < len(forwards) else None
        if following is not None:
            found.append(Segment(AFTER_FORWARD, k, last + 1, following - 1))
    found.append(Segment(MIDDLE, -1, forwards[-1][1] + 1, backwards[-1][0] - 1))
    for k in range(len(backwards) - 1, -1, -1):
        first, last = backwards[k]
        found.append(Segment(BACKWARD, k, first, last))
        if k:
            found.append(Segment(AFTER_BACKWARD, k, last + 1, backwards[k - 1][0] - 1))
    found.append(Segment(END, -1, backwards[0][1] + 1, n - 1))
    return tuple(s for s in found if s.first <= s.last)
