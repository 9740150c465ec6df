"""Lower a plan to checkpoint segments, and price exactly what the checkpoint runtime executes.

A plan says which forward tensors are kept for the backward. The checkpoint runtime
realises it with segments of consecutive forward ops: a segment ends where every tensor
crossing the boundary is kept anyway, so the next segment's inputs cost nothing extra.
Inside a checkpointed segment the kept tensors that the segment's own autograd nodes or
the recomputation read are saved (saving one that nothing reads would only hold memory);
the dropped tensors the backward reads, and the dropped ancestors they need within the
segment, are recomputed all at once when the first of the segment's autograd nodes that
saved a tensor runs; each recomputed tensor then lives until its last backward reader,
and the segment's inputs until the last of those nodes has run. A tensor the plan drops
but that the runtime must keep (it sits in a segment with nothing to recompute, it is
read by a later segment's backward, or an in-place op later overwrites it) is kept, and
the lowered schedule says so: every number reported for a plan is the lowered schedule's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from optremat.graph import Graph
from optremat.runtime.program import Segment
from optremat.heuristics.benefit import drop_order
from optremat.schedule import Schedule, SimResult, simulate


@dataclass(frozen=True, eq=False)
class Lowering:
    """Segments over the program's ops and the schedule they execute on the graph."""

    segments: tuple[Segment, ...]
    schedule: Schedule
    saved: np.ndarray


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


def lower(graph: Graph, kept: np.ndarray, program: np.ndarray, grad_of: np.ndarray) -> Lowering:
    """Segments that realise `kept` for the forward ops `program` (graph indices, run order);
    `grad_of` names, per backward op, the forward op whose autograd node runs it."""
    n, m = graph.n, len(program)
    position = np.full(n, -1, dtype=np.int64)
    position[program] = np.arange(m)
    resident = graph.pinned | graph.output
    base = graph.storage_root

    backward_reads, last_forward_read, hidden = _readers(graph, position, m)
    unpacks, ran = _unpacks(graph, grad_of)

    saved = np.asarray(kept, dtype=bool).copy()
    saved[_overwritten(graph, program)] = False
    saved = _by_storage(graph, saved, base) | resident
    segments = _segments(program, saved, last_forward_read)

    recompute: dict[int, list[int]] = {}
    held: dict[int, int] = {}
    lowered = []
    for start, stop in segments:
        members = program[start:stop].tolist()
        for v in members:
            if backward_reads[v] and last_forward_read[v] >= stop:
                saved[v] = True
        saved = _by_storage(graph, saved, base) | resident
        needed = _closure(graph, [v for v in members if backward_reads[v] and not saved[v]],
                          lambda p: start <= position[p] < stop and not saved[p])
        if needed and any(_over_a_value(graph, v) for v in members):
            saved[[v for v in members if backward_reads[v]]] = True
            saved = _by_storage(graph, saved, base) | resident
            needed = []
        if not needed:
            lowered.append(Segment(start, stop))
            continue
        frame = sorted(s for v in members for s in unpacks[v])
        t = frame[0] if frame else min(s for v in members for s in backward_reads[v])
        released = min(max([t] + [s + 1 for v in members for s in ran[v]]), n - 1)
        recompute.setdefault(t, []).extend(needed + [a for v in needed for a in hidden[v]])
        for v in members:
            for p in graph.preds[v].tolist():
                if not start <= position[p] < stop:
                    held[p] = max(held.get(p, released), released)
        read = {int(base[p]) for u in needed for p in graph.preds[u].tolist()}
        read |= {int(base[p]) for s in frame for p in graph.preds[s].tolist() if not graph.backward[p]}
        stored = frozenset(graph.names[v] for v in members if saved[v] and base[v] in read)
        lowered.append(Segment(start, stop, stored, frozenset(graph.names[v] for v in needed)))
    return Lowering(tuple(lowered), _schedule(graph, recompute, held), saved)


def fit(graph: Graph, kept: np.ndarray, program: np.ndarray, grad_of: np.ndarray,
        budget: int) -> tuple[Lowering, SimResult]:
    """The lowering of `kept` less the shortest prefix of the benefit order (most bytes
    per recompute-second first) whose simulated peak fits `budget`, or, when none fits,
    the one that drops the whole order (the least peak this search reaches)."""
    order = [v for v in drop_order(graph).tolist() if kept[v]]

    def attempt(count: int) -> tuple[Lowering, SimResult]:
        dropped = np.asarray(kept, dtype=bool).copy()
        dropped[order[:count]] = False
        lowering = lower(graph, dropped, program, grad_of)
        return lowering, simulate(graph, lowering.schedule)

    best = attempt(0)
    if best[1].peak_bytes <= budget:
        return best
    smallest = attempt(len(order))
    if smallest[1].peak_bytes > budget:
        return smallest
    best, lo, hi = smallest, 1, len(order)
    while lo < hi:
        mid = (lo + hi) // 2
        trial = attempt(mid)
        if trial[1].peak_bytes <= budget:
            best, hi = trial, mid
        else:
            lo = mid + 1
    return best


def boundary_keep_sets(graph: Graph, program: np.ndarray, thresholds: int = 12) -> list[np.ndarray]:
    """Chen-style keep sets for the segment runtime: walk the forward and, once a segment
    holds more than a threshold of bytes, end it at the nearby op where the fewest bytes
    cross; keep exactly what crosses the chosen boundaries. Thresholds sweep geometrically."""
    m = len(program)
    size = np.where(graph.alias_of[program] < 0, graph.size[program], 0).astype(np.int64)
    last_read = _last_read(graph, program)
    crossing = np.zeros(m + 2, dtype=np.int64)
    np.add.at(crossing, np.arange(m) + 1, size)
    np.add.at(crossing, np.maximum(last_read, np.arange(m)) + 1, -size)
    crossing = np.cumsum(crossing)[:m + 1]
    total = int(size.sum())
    if total == 0:
        return []
    keep_sets = []
    for threshold in np.geomspace(max(int(size[size > 0].min()), 1), total, thresholds):
        cuts, since, p = [], 0, 1
        while p < m:
            since += int(size[p - 1])
            if since >= threshold:
                window, extra = [p], since
                while extra < 1.5 * threshold and window[-1] + 1 < m:
                    extra += int(size[window[-1]])
                    window.append(window[-1] + 1)
                p = min(window, key=lambda q: (crossing[q], q))
                cuts.append(p)
                since = 0
            p += 1
        keep_sets.append(_crossing(graph, program, last_read, cuts))
    return keep_sets


def module_keep_sets(graph: Graph, program: np.ndarray, strides: tuple[int, ...] = (1, 2, 3, 4)) -> list[np.ndarray]:
    """Keep sets that cut the forward where a module at some depth of the module tree
    starts (every block, every second block, ...), as hand-written per-block
    checkpointing does; keep exactly what crosses the cuts."""
    paths = [graph.module[v].split(".") if graph.module[v] else [] for v in program.tolist()]
    last_read = _last_read(graph, program)
    keep_sets, seen = [], set()
    for depth in range(1, max((len(p) for p in paths), default=0) + 1):
        starts = [k for k in range(1, len(paths))
                  if len(paths[k]) >= depth and paths[k][:depth] != paths[k - 1][:depth]]
        for stride in strides:
            cuts = tuple(starts[stride - 1::stride])
            if cuts and cuts not in seen:
                seen.add(cuts)
                keep_sets.append(_crossing(graph, program, last_read, list(cuts)))
    return keep_sets


def _readers(graph: Graph, position: np.ndarray, m: int) -> tuple[list[list[int]], np.ndarray, list[list[int]]]:
    """Per node: the backward ops that read it, the last program position that reads it
    in the forward (`m` for a read after the program, by the loss), and the aliases
    outside the program (a `detach` the traced graph saves a tensor through): those are
    looked through, their readers counted as the node's, and recomputed with it."""
    n = graph.n
    backward, succs, alias_of, is_part = graph.backward, graph.succs, graph.alias_of, graph.is_part
    backward_reads: list[list[int]] = [[] for _ in range(n)]
    last = np.full(n, -1, dtype=np.int64)
    hidden: list[list[int]] = [[] for _ in range(n)]
    for v in range(n):
        stack = [v]
        while stack:
            u = stack.pop()
            for s in succs[u].tolist():
                if backward[s]:
                    backward_reads[v].append(s)
                elif position[s] >= 0:
                    last[v] = max(last[v], position[s])
                elif alias_of[s] == u and not is_part[s] and not graph.output[s] and succs[s].size:
                    hidden[v].append(s)
                    stack.append(s)
                else:
                    last[v] = max(last[v], m)
    return backward_reads, last, hidden


def _unpacks(graph: Graph, grad_of: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
    """Per forward op, the backward ops its autograd node runs that read a forward tensor
    (under checkpoint, those unpack what the node saved), and all the ops it runs (once
    the last has run, the node releases what it saved)."""
    unpacks: list[list[int]] = [[] for _ in range(graph.n)]
    ran: list[list[int]] = [[] for _ in range(graph.n)]
    for s in np.nonzero(graph.backward & (grad_of >= 0))[0].tolist():
        ran[int(grad_of[s])].append(s)
        if any(not graph.backward[p] for p in graph.preds[s].tolist()):
            unpacks[int(grad_of[s])].append(s)
    return unpacks, ran


def _last_read(graph: Graph, program: np.ndarray) -> np.ndarray:
    """Per program position, the last position whose op reads that op's storage in the
    forward (len(program) for reads after the program)."""
    m = len(program)
    position = np.full(graph.n, -1, dtype=np.int64)
    position[program] = np.arange(m)
    base = graph.storage_root
    last = _readers(graph, position, m)[1]
    reach = np.full(graph.n, -1, dtype=np.int64)
    for k, v in enumerate(program.tolist()):
        reach[base[v]] = max(reach[base[v]], k, last[v])
    return reach[program]


def _crossing(graph: Graph, program: np.ndarray, last_read: np.ndarray, cuts: list[int]) -> np.ndarray:
    """Keep exactly the tensors that cross one of `cuts` (program positions)."""
    kept = np.zeros(graph.n, dtype=bool)
    positions = np.arange(len(program))
    for cut in cuts:
        kept[program[(positions < cut) & (last_read >= cut)]] = True
    return kept


def _closure(graph: Graph, nodes: list[int], inside: Callable[[int], bool]) -> list[int]:
    """`nodes` and their ancestors reachable through nodes for which `inside` holds, sorted."""
    seen = set(nodes)
    stack = list(nodes)
    while stack:
        for p in graph.preds[stack.pop()].tolist():
            if p not in seen and inside(p):
                seen.add(p)
                stack.append(p)
    return sorted(seen)


def _by_storage(graph: Graph, saved: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Saving is per storage: a view keeps its base. Each output of a multi-output op is
    saved on its own, and the op itself is rerun whenever a part it produces is needed."""
    out = np.zeros_like(saved)
    np.logical_or.at(out, base, saved)
    out[graph.alias_of[graph.is_part]] = False
    return out[base]


def _overwritten(graph: Graph, program: np.ndarray) -> list[int]:
    """Storage bases that an in-place forward op writes: a saved copy would go stale."""
    base = graph.storage_root
    return [int(base[graph.alias_of[v]]) for v in program.tolist() if _in_place(graph, v)]


def _in_place(graph: Graph, v: int) -> bool:
    """An op that writes its result over its input's storage."""
    return bool(graph.alias_of[v] >= 0) and graph.ops[v].split(".")[0].endswith("_")


def _over_a_value(graph: Graph, v: int) -> bool:
    """An in-place op that overwrites a computed activation. Replaying a segment holding
    one under checkpoint has given wrong gradients (LSTMCell's in-place gates on the
    CPU), so such segments run plainly. Buffer updates (BatchNorm's running statistics)
    replay on scratch copies, and writes into a fresh allocation (dropout's mask) replay
    the same way, so neither counts."""
    if not _in_place(graph, v):
        return False
    root = int(graph.storage_root[graph.alias_of[v]])
    fresh = graph.ops[root].split(".")[0] in ("empty", "empty_like", "new_empty")
    return not (graph.pinned[root] or graph.output[root] or fresh)


def _segments(program: np.ndarray, saved: np.ndarray, last_forward_read: np.ndarray) -> list[tuple[int, int]]:
    """Cut before every op where all tensors crossing the cut are saved (or resident)."""
    cuts = [0]
    reach = -1
    for p, v in enumerate(program.tolist()):
        if p > 0 and reach < p:
            cuts.append(p)
        if not saved[v]:
            reach = max(reach, int(last_forward_read[v]))
    cuts.append(len(program))
    return list(zip(cuts[:-1], cuts[1:]))


def _schedule(graph: Graph, recompute: dict[int, list[int]], held: dict[int, int]) -> Schedule:
    """Each node in its own stage, plus the recomputations; copies live until their last
    reader, and a checkpointed segment's inputs until its autograd nodes release them (`held`:
    the stage they are freed at the start of)."""
    n = graph.n
    until = np.arange(n)
    again: dict[tuple[int, int], int] = {}
    recomputed_at = {v: t for t, nodes in recompute.items() for v in nodes}
    for v in range(n):
        for s in graph.succs[v].tolist():
            if graph.backward[s] and v in recomputed_at:
                key = (v, recomputed_at[v])
                again[key] = max(again.get(key, key[1]), s)
            else:
                until[v] = max(until[v], s)
    for t, nodes in recompute.items():
        for v in nodes:
            again.setdefault((v, t), t)
            for p in graph.preds[v].tolist():
                if recomputed_at.get(p) != t:
                    until[p] = max(until[p], t)
    for v, t in held.items():
        until[v] = max(until[v], t)
    until[graph.pinned | graph.output] = n - 1
    events = [(v, v, int(until[v])) for v in range(n)] + [(v, t, u) for (v, t), u in again.items()]
    return Schedule.from_events(events, n)
