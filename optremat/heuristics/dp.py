"""Checkpointing by dynamic programming over the chain of blocks a training graph's forward
pass splits into (Griewank's revolve generalised as in Rotor, Beaumont et al. 2019).

The forward pass is cut at cut points (forward tensors no forward edge jumps over) into
blocks 1..L; block k's output c_k is the only forward tensor block k+1 reads from below.
The backward pass is cut where each block's backward starts: s_k, the first backward node
reading block k's tensors or its input c_(k-1), so the backward runs blocks L..1 in turn.
Blocks whose backward would not run in that order are merged.

The DP prices a block by its bytes and costs: `x` (its output), `inner` (what its own
backward reads), the peak of running its forward, and the state its backward enters.
`backward(a, b, m)` is the least recomputation that runs the backward of blocks b..a+1
with c_a kept and m bytes free. Its options are Rotor's:
- leaf (b = a+1): recompute the block's inner tensors, then run its backward;
- checkpoint: advance from c_a to some c_j (recomputing blocks a+1..j), solve b..j+1
  with c_j kept, then j..a+1;
- keep all of block a+1: compute it with its inner tensors, solve b..a+2 with them held,
  then run block a+1's backward directly.
The first forward sweep makes the same choices at no recomputation cost. Every peak is
checked against the free bytes, so on a training chain (one op per block) the model is
`simulate`'s own, and the DP is optimal among persistent nested schedules. On other
graphs it is a model: the plan is lowered to a Schedule, simulated, and the DP's budget
is corrected until the simulated peak fits.

Memory is counted in slots (the bytes' common divisor when that is fine enough, else a
1/MAX_SLOTS share of the budget) so that one solve prices every budget at once; chains of
more than MAX_BLOCKS blocks are planned over merged blocks, which keeps it fast at the
price of optimality.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

import numpy as np

from optremat.core.budget import InfeasibleBudget
from optremat.core.graph import Graph
from optremat.core.schedule import Schedule, from_computations, keep_all, run_peak, simulate
from optremat.heuristics.chen import cut_points
from optremat.heuristics.select import droppable

MAX_BLOCKS = 64
MAX_SLOTS = 256
HEADROOM = 1.25
"""The DP prices budgets up to this multiple of the asked one, room for correcting its model."""
TRIES = 12
"""Most plans of one DP solve lowered and simulated in search of the cheapest that fits."""


class NotAChain(ValueError):
    """The graph has no forward pass apart from its backward, so the DP does not apply."""


@dataclass(frozen=True)
class Blocks:
    """A training graph's block chain (index 0 stands for the graph's inputs).

    Per block k: `advance[k]` the forward ops that produce c_k, `full[k]` those that also
    produce `inner[k]`, `leaf[k]` those that produce `inner[k]` alone; `start[k]` = s_k.
    Byte figures are per block, beyond the kept checkpoints: `x` c_k, `hold` c_k and
    inner[k] together, `peak_from` / `peak_after` the peak of running `advance` with its
    input live until read / already counted, `peak_full` of running `full`, `entering` the
    gradients and outputs live at s_k, `direct_need` the peak of the block's backward from
    those with inner[k] held (less c_(k-1) when that backward does not read it, for it is
    freed first), `leaf_need` that or the peak of recomputing inner[k] first.
    """

    cut: tuple[int, ...]
    start: tuple[int, ...]
    advance: tuple[tuple[int, ...], ...]
    full: tuple[tuple[int, ...], ...]
    leaf: tuple[tuple[int, ...], ...]
    x: np.ndarray
    hold: np.ndarray
    peak_from: np.ndarray
    peak_after: np.ndarray
    peak_full: np.ndarray
    leaf_need: np.ndarray
    direct_need: np.ndarray
    entering: np.ndarray
    cost_advance: np.ndarray
    cost_full: np.ndarray
    cost_leaf: np.ndarray

    @property
    def length(self) -> int:
        return len(self.cut) - 1


def block_chain(graph: Graph, max_blocks: int = MAX_BLOCKS) -> Blocks:
    """The block chain of a training graph, merged to at most `max_blocks` blocks."""
    forward = droppable(graph)
    if not graph.backward.any() or not forward.any():
        raise NotAChain("dp plans training graphs: it needs forward ops and backward ops marked apart")
    if np.nonzero(forward)[0].max() > np.nonzero(graph.backward)[0].min():
        raise NotAChain("dp needs the whole forward pass before the backward in the graph's order")
    cuts = _ordered(graph, forward, cut_points(graph).tolist())
    if len(cuts) > max_blocks:
        cuts = _ordered(graph, forward, _fewer(graph, forward, cuts, max_blocks))
    return _describe(graph, forward, cuts)


def _starts(graph: Graph, forward: np.ndarray, cuts: list[int]) -> list[int | None]:
    """s_k for each block under `cuts` (None where no backward node reads the block)."""
    n = graph.n
    block = np.searchsorted(np.array(cuts), np.arange(n))
    src, dst = graph.edges[:, 0], graph.edges[:, 1]
    reads = forward[src] & graph.backward[dst]
    src, dst = src[reads], dst[reads]
    owner = block[src] + np.isin(src, cuts).astype(np.int64)
    first = np.full(len(cuts) + 1, n, dtype=np.int64)
    np.minimum.at(first, owner, dst)
    return [None if s == n else int(s) for s in first[:len(cuts)].tolist()]


def _ordered(graph: Graph, forward: np.ndarray, cuts: list[int]) -> list[int]:
    """`cuts` less those that would leave a block no backward node reads, or a block
    whose backward does not start after the backward of the block above it."""
    cuts = list(cuts)
    while True:
        start = _starts(graph, forward, cuts)
        top = len(cuts) - 1
        bad = next((k for k in range(top, -1, -1)
                    if start[k] is None or (k < top and None not in (start[k], start[k + 1]) and start[k] <= start[k + 1])), None)
        if bad is None or len(cuts) == 1:
            return cuts
        del cuts[bad if bad < top else bad - 1]


def _fewer(graph: Graph, forward: np.ndarray, cuts: list[int], count: int) -> list[int]:
    """`count` of `cuts` (the last always among them) spreading forward cost and bytes evenly."""
    weight = np.where(forward, graph.cost / max(graph.cost[forward].sum(), 1e-12)
                      + graph.size / max(graph.size[forward].sum(), 1), 0.0)
    at_cut = np.cumsum(weight)[cuts]
    targets = at_cut[-1] * np.arange(1, count) / count
    chosen = sorted(set(np.searchsorted(at_cut, targets).tolist()) | {len(cuts) - 1})
    return [cuts[i] for i in chosen]


def _describe(graph: Graph, forward: np.ndarray, cuts: list[int]) -> Blocks:
    n, length = graph.n, len(cuts)
    start = [n if s is None else s for s in _starts(graph, forward, cuts)]
    bounds = [-1] + cuts
    ends = [n] + start
    last_read = np.full(n, -1, dtype=np.int64)
    np.maximum.at(last_read, graph.edges[:, 0], graph.edges[:, 1])
    resident = graph.output & ~graph.pinned
    tail = cuts[-1]
    unit_bytes = graph.unit_size

    def owned(nodes) -> int:
        return int(sum(unit_bytes[u] for u in {u for v in nodes for u in graph.units[v]}))

    x = [0] + [owned([c]) for c in cuts]
    fields: dict[str, list] = {key: [()] if key in ("advance", "full", "leaf") else [0] for key in (
        "advance", "full", "leaf", "hold", "peak_from", "peak_after", "peak_full", "leaf_need", "direct_need",
        "entering", "cost_advance", "cost_full", "cost_leaf")}
    previous_inner: set[int] = set()
    for k in range(1, length + 1):
        lo, c, s, s_end = bounds[k - 1], cuts[k - 1], start[k - 1], ends[k - 1]
        ops = [v for v in range(lo + 1, c + 1) if forward[v]]
        segment = [v for v in range(s, s_end) if graph.backward[v]]
        seg_reads = {p for v in segment for p in graph.preds[v].tolist()}
        inner = [v for v in ops if v in seg_reads and v != tail]
        within = np.zeros(graph.n, dtype=bool)
        within[ops] = True
        advance = graph.ancestors([c] if within[c] else [], within)
        full = graph.ancestors([v for v in [c] + inner if within[v]], within)
        leaf = graph.ancestors(inner, within)
        entering = [v for v in range(s) if not graph.pinned[v] and (graph.backward[v] or v == tail or resident[v])
                    and (resident[v] or last_read[v] >= s)]
        fields["advance"].append(tuple(advance))
        fields["full"].append(tuple(full))
        fields["leaf"].append(tuple(leaf))
        fields["hold"].append(owned([c] + inner))
        into = [lo] if lo >= 0 else []
        fields["peak_from"].append(run_peak(graph, advance, into, {c}))
        fields["peak_after"].append(run_peak(graph, advance, [], {c}))
        fields["peak_full"].append(run_peak(graph, full, [], {c, *inner}))
        entering_bytes = owned(entering)
        live_in = entering + inner
        released = lo >= 0 and lo not in seg_reads and lo not in previous_inner
        previous_inner = set(inner)
        direct = run_peak(graph, segment, live_in, {v for v in live_in if resident[v] or last_read[v] >= s_end}
                           | {v for v in segment if resident[v] or last_read[v] >= s_end})
        fields["entering"].append(entering_bytes)
        direct -= x[k - 1] if released else 0
        fields["leaf_need"].append(max(entering_bytes + run_peak(graph, leaf, [], inner), direct))
        fields["direct_need"].append(direct)
        for key, nodes in (("cost_advance", advance), ("cost_full", full), ("cost_leaf", leaf)):
            fields[key].append(float(graph.cost[list(nodes)].sum()) if nodes else 0.0)
    arrays = {key: np.array(value) for key, value in fields.items() if key not in ("advance", "full", "leaf")}
    return Blocks(cut=tuple([-1] + cuts), start=tuple([n] + start), advance=tuple(fields["advance"]),
                  full=tuple(fields["full"]), leaf=tuple(fields["leaf"]), x=np.array(x), **arrays)


@dataclass(frozen=True)
class _Tables:
    """The DP's value and choice tables over free slots 0..slots (see `_solve`), and the
    block bytes they were solved with, in slots."""

    backward: np.ndarray
    backward_choice: np.ndarray
    sweep: np.ndarray
    sweep_choice: np.ndarray
    slot: int
    pad: int
    x: np.ndarray
    hold: np.ndarray


FULL = -1
"""Choice code: keep all of the lowest block (in the sweep, of the next one)."""


def _solve(blocks: Blocks, slot: int, slots: int) -> _Tables:
    """backward[a, b, pad + m] and sweep[a, pad + m]: least recomputation with m free slots."""
    length = blocks.length
    up = lambda values: np.ceil(np.asarray(values) / slot).astype(np.int64)
    x, hold, entering = up(blocks.x), up(blocks.hold), up(blocks.entering)
    peak_from, peak_after, peak_full = up(blocks.peak_from), up(blocks.peak_after), up(blocks.peak_full)
    leaf_need, direct_need = up(blocks.leaf_need), up(blocks.direct_need)
    pad = int(min(max(int(hold.max()), int(x.max())), slots + 1))
    width = pad + slots + 1
    free = np.arange(slots + 1)
    advance_need = np.zeros((length + 1, length + 1), dtype=np.int64)
    for a in range(length):
        running = peak_after[a + 1]
        for j in range(a + 1, length + 1):
            if j > a + 1:
                running = max(running, peak_from[j])
            advance_need[a, j] = running
    cumulative = np.concatenate([[0.0], np.cumsum(blocks.cost_advance[1:])])
    advance_cost = cumulative[None, :] - cumulative[:, None]

    backward = np.full((length + 1, length + 1, width), np.inf)
    choice = np.zeros((length + 1, length + 1, width), dtype=np.int32)
    for b in range(1, length + 1):
        backward[b - 1, b, pad:] = np.where(free >= leaf_need[b], blocks.cost_leaf[b], np.inf)
        choice[b - 1, b, pad:] = FULL
        for a in range(b - 2, -1, -1):
            js = np.arange(a + 1, b)
            rows = (pad - x[js])[:, None] + free[None, :]
            upper = backward[js[:, None], b, np.clip(rows, 0, None)]
            upper[rows < 0] = np.inf
            candidates = advance_cost[a, js][:, None] + upper + backward[a, a + 1:b, pad:]
            candidates[free[None, :] < entering[b] + advance_need[a, js][:, None]] = np.inf
            keep = blocks.cost_full[a + 1] + _shifted(backward[a + 1, b], pad, hold[a + 1], slots)
            keep[(free < entering[b] + peak_full[a + 1]) | (free < direct_need[a + 1])] = np.inf
            best = candidates.argmin(axis=0)
            values = candidates[best, free]
            use_keep = keep < values
            backward[a, b, pad:] = np.where(use_keep, keep, values)
            choice[a, b, pad:] = np.where(use_keep, FULL, js[best])

    sweep = np.full((length + 1, width), np.inf)
    sweep_choice = np.zeros((length + 1, width), dtype=np.int32)
    sweep[length, pad:] = 0.0
    for a in range(length - 1, -1, -1):
        options = [np.where(free >= advance_need[a, length], backward[a, length, pad:], np.inf)]
        codes = [length]
        for j in range(a + 1, length):
            value = _shifted(sweep[j], pad, x[j], slots) + backward[a, j, pad:]
            options.append(np.where(free >= advance_need[a, j], value, np.inf))
            codes.append(j)
        keep = _shifted(sweep[a + 1], pad, hold[a + 1], slots)
        options.append(np.where((free >= peak_full[a + 1]) & (free >= direct_need[a + 1]),
                                keep, np.inf))
        codes.append(FULL)
        stacked = np.vstack(options)
        best = stacked.argmin(axis=0)
        sweep[a, pad:] = stacked[best, free]
        sweep_choice[a, pad:] = np.array(codes)[best]
    return _Tables(backward, choice, sweep, sweep_choice, slot, pad, x, hold)


def _shifted(row: np.ndarray, pad: int, by: int, slots: int) -> np.ndarray:
    """row's values at m - by for m = 0..slots (inf below zero)."""
    if by > pad:
        return np.full(slots + 1, np.inf)
    return row[pad - by:pad - by + slots + 1].copy()


def _lower(graph: Graph, blocks: Blocks, tables: _Tables, free: int) -> Schedule:
    """The schedule of the DP's choices with `free` slots."""
    x, hold, pad, length = tables.x, tables.hold, tables.pad, blocks.length
    computations: list[tuple[int, int]] = []
    pending: list[tuple[int, int, int]] = []
    a, m = 0, free
    while a < length:
        j = int(tables.sweep_choice[a, pad + m])
        if j == length:
            pending.append((a, length, m))
            break
        if j == FULL:
            a, m = a + 1, m - int(hold[a + 1])
            continue
        pending.append((a, j, m))
        a, m = j, m - int(x[j])
    while pending:
        a, b, m = pending.pop()
        stage = blocks.start[b]
        j = int(tables.backward_choice[a, b, pad + m])
        if b == a + 1:
            computations += [(v, stage) for v in blocks.leaf[b]]
        elif j == FULL:
            computations += [(v, stage) for v in blocks.full[a + 1]]
            pending.append((a + 1, b, m - int(hold[a + 1])))
        else:
            computations += [(v, stage) for k in range(a + 1, j + 1) for v in blocks.advance[k]]
            pending += [(a, j, m), (j, b, m - int(x[j]))]
    return from_computations(graph, computations)


def _resolution(blocks: Blocks, free_bytes: int) -> tuple[int, int]:
    """(slot bytes, slots) covering `free_bytes`: exact when the bytes' divisor allows."""
    figures = [int(v) for values in (blocks.x, blocks.hold, blocks.peak_from, blocks.peak_after, blocks.peak_full,
                                     blocks.leaf_need, blocks.direct_need, blocks.entering) for v in values]
    divisor = reduce(math.gcd, figures + [free_bytes]) or 1
    if free_bytes // divisor <= 4 * MAX_SLOTS:
        return divisor, free_bytes // divisor
    slot = math.ceil(free_bytes / MAX_SLOTS)
    return slot, free_bytes // slot


def chain_dp(graph: Graph, budget: int, *, max_blocks: int = MAX_BLOCKS) -> Schedule:
    """The cheapest nested checkpointing schedule the block-chain DP finds within `budget`,
    over at most `max_blocks` blocks (time grows with their cube).

    Raises NotAChain for a graph without a forward pass marked apart from its backward,
    and InfeasibleBudget naming the smallest peak it reached otherwise.
    """
    blocks = block_chain(graph, max_blocks)
    unplanned = simulate(graph, keep_all(graph)).peak_bytes
    peaks = []
    for top in (int(budget * HEADROOM), unplanned):
        found, tried = _search(graph, blocks, budget, max(top - graph.pinned_bytes, 0))
        if found is not None:
            return found
        peaks += tried
    raise InfeasibleBudget(budget, min(peaks, default=unplanned), "dp")


def _search(graph: Graph, blocks: Blocks, budget: int, free_bytes: int) -> tuple[Schedule | None, list[int]]:
    """The cheapest of the DP's plans for up to `free_bytes` free that simulates within
    `budget` (or None), and the peaks of those tried. The model may err either way, so
    the search starts at the cheapest plan, steps down by each miss's excess until a plan
    fits, then bisects between the two for the cheapest that fits (at most TRIES plans);
    when none fits, the least-memory plan is tried too."""
    slot, slots = _resolution(blocks, free_bytes)
    tables = _solve(blocks, slot, slots)
    values = tables.sweep[0, tables.pad:]
    changes = np.nonzero(np.isfinite(values) & (values < np.concatenate([[np.inf], values[:-1]])))[0]
    tried: dict[int, tuple[int, float, Schedule]] = {}

    def peak(index: int) -> int:
        if index not in tried:
            schedule = _lower(graph, blocks, tables, int(changes[index]))
            result = simulate(graph, schedule)
            tried[index] = (result.peak_bytes, result.cost, schedule)
        return tried[index][0]

    missed, index = len(changes), len(changes) - 1
    while index >= 0 and len(tried) < TRIES and peak(index) > budget:
        missed = index
        target = changes[index] - math.ceil((peak(index) - budget) / slot)
        index = min(int(np.searchsorted(changes, target, side="right")) - 1, index - 1)
    fitted = index
    while fitted >= 0 and missed - fitted > 1 and len(tried) < TRIES:
        middle = (fitted + missed) // 2
        fitted, missed = (middle, missed) if peak(middle) <= budget else (fitted, middle)
    fitting = [(cost, schedule) for p, cost, schedule in tried.values() if p <= budget]
    if not fitting and len(changes) and peak(0) <= budget:
        fitting = [tried[0][1:]]
    best = min(fitting, key=lambda pair: pair[0])[1] if fitting else None
    return best, [p for p, _, _ in tried.values()]
