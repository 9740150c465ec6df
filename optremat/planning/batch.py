"""The step of a built-in model at any batch size, by way of running it, for `max_batch`:
as built, or with its LM head whole and in each token chunk count priced."""

from __future__ import annotations

from typing import Callable

from optremat.core.graph import Graph
from optremat.models import build
from optremat.planners.batch import graph_at
from optremat.planning.chunking import choices
from optremat.tracing.extract import extract

TRACED = (2, 3)
"""The batch sizes a step is traced at, its graph at any other interpolated from theirs."""

Way = tuple[str, Callable[[int], Graph]]
"""A way of running the step ("" as built, else e.g. "4 chunks") and its graph at any batch."""


def batch_ways(model: str, head_chunks: bool = False, device: str = "cpu") -> list[Way]:
    """The built-in `model`'s step at any batch, traced at batch 2 and 3 (on fake
    tensors, with `device`'s roofline costs): as built, or with `head_chunks` a GPT's
    head and loss in `CausalLMLoss`, first whole, then in each chunk count priced. Not at
    batch 1: a CPU runs a float32 convolution of one sample in ATen's own kernel, which
    unfolds it into columns, and those of two or more in oneDNN's, which does not."""
    examples = [build(model, batch=batch, head_in_loss=head_chunks) for batch in TRACED]
    ways = []
    for chunks in choices(examples[0].loss_fn.tokens()) if head_chunks else (None,):
        graphs = [extract(e.model, e.inputs, e.loss_fn.with_chunks(chunks) if head_chunks else e.loss_fn,
                          device=device) for e in examples]
        ways.append(("" if chunks is None else f"{chunks} chunks", graph_at(graphs[0], graphs[1], *TRACED)))
    return ways
