"""An LM head's chunk loop traced through five chunks, the rest copied.

A chunked head's loop (`tracing.chunked`) runs the same ops on every chunk but the last,
which may be shorter. Traced on fake tensors, each op costs about a millisecond, so
PyTorch's 36 ops a chunk made a Llama-7B's 128-chunk step take 6 s more to trace than
its whole head, and `optremat.plan` traces every count it prices. A trace under
`chunked.loops_shortened` runs chunks 0 to 3 and the last, each op marked with its
chunk; here the fourth chunk's ops are copied for the chunks left out, as
`tracing.repeat` copies a block's, once the trace shows the third and fourth chunks
alike (the same ops, sizes and costs, reading their neighbours at the same offsets and
the same tensors from outside: the first chunk counts as outside, as it also makes what
the loop makes on first use). The expanded step is the one a trace of every
chunk records, node for node but for the names (tests/test_chunk_copies.py compares them).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from optremat.tracing.chunked import KEPT_CHUNKS
from optremat.tracing.repeat import NO_SPAN, Copies, Layout, NotAlike, signature
from optremat.tracing.traced import Traced


def chunks_expanded(traced: Traced, marks: Sequence[int | None]) -> Traced:
    """The step `traced` records with every chunk of its loop: `marks` gives each Graph
    node's chunk (None outside the loop). `traced` itself where no loop was shortened;
    NotAlike where the chunks traced do not lie one after another or do not repeat."""
    kept = sorted({m for m in marks if m is not None})
    if not kept:
        return traced
    count = kept[-1] + 1
    if kept != sorted({i % count for i in KEPT_CHUNKS}):
        raise NotAlike("more than one chunk loop")
    spans = _spans(marks, kept)[1:]
    layout = Layout(forward=spans, backward=(NO_SPAN,) * len(spans), places=((),) * len(spans))
    if signature(traced, layout, 1, None) != signature(traced, layout, 2, None):
        raise NotAlike("the third and fourth chunks differ")
    copies = Copies(traced, layout, None, count - 1)
    return replace(traced, graph=copies.graph(), grad_of=copies.column(traced.grad_of),
                   gradient_nodes=tuple(copies.at[(v, None)] for v in traced.gradient_nodes),
                   calls=tuple(copies.calls(traced.calls[v], j) for v, j in copies.order),
                   random=tuple(traced.random[v] for v, _ in copies.order))


def _spans(marks: Sequence[int | None], kept: list[int]) -> tuple[tuple[int, int], ...]:
    """Each kept chunk's nodes as a span of the step; NotAlike unless each chunk's nodes
    lie together, in the loop's order."""
    spans = []
    for chunk in kept:
        at = [v for v, m in enumerate(marks) if m == chunk]
        if at[-1] - at[0] + 1 != len(at) or (spans and at[0] != spans[-1][1]):
            raise NotAlike(f"chunk {chunk}'s ops do not lie together after the chunk before")
        spans.append((at[0], at[-1] + 1))
    return tuple(spans)
