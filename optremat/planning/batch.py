"""The step of a built-in model at any batch size, by way of running it, for `max_batch`:
as built, or with its LM head whole and in each token chunk count priced."""

from __future__ import annotations

from typing import Callable

from optremat.core.graph import Graph
from optremat.models import build
from optremat.planners.batch import graph_at
from optremat.planning.chunking import choices
from optremat.tracing.extract import extract

Way = tuple[str, Callable[[int], Graph]]
"""A way of running the step ("" as built, else e.g. "4 chunks") and its graph at any batch."""


def batch_ways(model: str, head_chunks: bool = False, device: str = "cpu") -> list[Way]:
    """The built-in `model`'s step at any batch, traced at batch 1 and 2 (on fake
    tensors, with `device`'s roofline costs): as built, or with `head_chunks` a GPT's
    head and loss in `CausalLMLoss`, first whole, then in each chunk count priced."""
    examples = [build(model, batch=batch, head_in_loss=head_chunks) for batch in (1, 2)]
    ways = []
    for chunks in choices(examples[0].loss_fn.tokens()) if head_chunks else (None,):
        graphs = [extract(e.model, e.inputs, e.loss_fn.with_chunks(chunks) if head_chunks else e.loss_fn,
                          device=device) for e in examples]
        ways.append(("" if chunks is None else f"{chunks} chunks", graph_at(graphs[0], graphs[1], 1, 2)))
    return ways
