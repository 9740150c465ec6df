"""Two ways of running the LM head and its loss in token chunks, measured side by side:
each chunk's gradients taken in the forward, or each chunk's logits recomputed in the
backward.

    python -m benchmarks.chunk_variants [--rounds 9] [--chunks 2,8]

The model is gpt-mini's shape (`optremat.models.HiddenGPT`: vocabulary 8192, 256 tokens,
width 256, 4 blocks, batch 4) returning its final hidden states, with every block under
non-reentrant `torch.utils.checkpoint` and with none, the hidden states held through the
backward (as a training loop holds them). The loss is the shifted causal cross-entropy over its tied
head, run by PyTorch's `F.linear_cross_entropy` with `LinearCrossEntropyOptions(batch_chunk_size=tokens / k)`:
with `reduction="mean"` its chunked op takes each chunk's gradients in the forward, and
with `reduction="none"` (summed and divided by the labelled tokens) it keeps each token's
log-sum-exp and recomputes the chunk's logits in the backward. Both run the same kernels,
so the rows differ only in that choice; `optremat.CausalLMLoss` with k chunks (gradients
in the forward, optremat's own chunks) is beside them. The CPU flushes float32 denormals
to zero here (`torch.set_flush_denormal`), so that PyTorch's chunked `exp` runs at its
normal speed (see `optremat/tracing/chunked.py`, `EXP_FLOOR`). Peaks as
`benchmarks.chunked` measures them (parameters, inputs and labels resident); step times
from interleaved rounds, each row's the median of its per-round ratio to the
gradients-in-the-forward row with the same chunks and blocks; losses and gradients are checked
equal to the whole head's first.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import optremat
from benchmarks.chunked import BATCH, SHAPE
from benchmarks.native import _seconds
from benchmarks.report import write_rows
from optremat.bench import checkpointed_blocks
from optremat.core.graph import format_bytes
from optremat.models import HiddenGPT
from optremat.plots import plot_lines
from optremat.runtime.measure import measure_peak

HEADER = ["blocks", "chunks", "loss", "gradients of a chunk", "measured peak", "step time / gradients in the forward (median)"]
Loss = Callable[[torch.Tensor], torch.Tensor]


def torch_chunks(head: nn.Module, labels: torch.Tensor, chunks: int, reduction: str) -> Loss:
    """The shifted causal LM loss in `F.linear_cross_entropy`, tokens / `chunks` rows at a
    time; with `reduction` "none" the per-token losses summed over the labelled tokens."""
    shifted = F.pad(labels[..., 1:], (0, 1), value=-100).reshape(-1)
    options = nn.LinearCrossEntropyOptions(batch_chunk_size=shifted.numel() // chunks)
    labelled = (shifted != -100).sum()

    def loss(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        if reduction == "mean":
            return F.linear_cross_entropy(flat, head.weight, shifted, options=options)
        return F.linear_cross_entropy(flat, head.weight, shifted, reduction="none", options=options).sum() / labelled

    return loss


def rows(rounds: int, counts: tuple[int, ...]) -> tuple[list[list[str]], dict[str, list[tuple[float, float]]]]:
    """Each chunk count's three ways, measured as the module docstring says: the table's
    rows, and per way its (measured MiB, step time ratio) points."""
    torch.manual_seed(0)
    model = HiddenGPT(**SHAPE)
    idx = torch.randint(0, SHAPE["vocab"], (BATCH, SHAPE["seq"]))
    labels = torch.randint(0, SHAPE["vocab"], (BATCH, SHAPE["seq"]))
    params = list(model.parameters())
    blocks = [f"blocks.{i}" for i in range(SHAPE["layers"])]

    def step_of(loss_fn: Loss, checkpointed: list[str]) -> Callable[[], Any]:
        def step() -> Any:
            with checkpointed_blocks(model, checkpointed):
                out = model(idx)  # held through the backward
                loss = loss_fn(out)
                return loss.detach(), torch.autograd.grad(loss, params)
        return step

    reference = step_of(optremat.CausalLMLoss(model.head, labels, chunks=None), [])()
    ways: dict[tuple[str, int, str], tuple[str, Callable[[], Any]]] = {}
    for kind, checkpointed in (("all checkpointed", blocks), ("none checkpointed", [])):
        for k in counts:
            ways[kind, k, "forward"] = ("F.linear_cross_entropy, mean",
                                        step_of(torch_chunks(model.head, labels, k, "mean"), checkpointed))
            ways[kind, k, "backward"] = ("F.linear_cross_entropy, none",
                                         step_of(torch_chunks(model.head, labels, k, "none"), checkpointed))
            ways[kind, k, "optremat"] = ("optremat.CausalLMLoss",
                                         step_of(optremat.CausalLMLoss(model.head, labels, chunks=k), checkpointed))
    for key, (name, step) in ways.items():
        loss, grads = step()
        torch.testing.assert_close(loss, reference[0], rtol=1e-5, atol=1e-5, msg=f"{key}: loss")
        for got, want in zip(grads, reference[1]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"{key}: gradients")
    resident = [params, list(model.buffers()), idx, labels]
    peaks = {key: measure_peak(step, resident=resident).peak_bytes for key, (_, step) in ways.items()}
    seconds: dict[tuple[str, int, str], list[float]] = {key: [] for key in ways}
    order = random.Random(0)
    for _ in range(rounds):
        keys = list(ways)
        order.shuffle(keys)
        for key in keys:
            seconds[key].append(_seconds(ways[key][1], "cpu"))
    table, points = [], {}
    for (kind, k, way), (name, _) in ways.items():
        ratio = statistics.median(m / b for m, b in zip(seconds[kind, k, way], seconds[kind, k, "forward"]))
        gradients = "recomputed in the backward" if way == "backward" else "taken in the forward"
        table.append([kind, str(k), name, gradients, format_bytes(peaks[kind, k, way]), f"{ratio:.3f}"])
        points.setdefault(f"{name}, gradients {gradients}", []).append((peaks[kind, k, way] / 2**20, ratio))
    return table, points


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--chunks", default="2,8", help="chunk counts, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread, no GPU"
    command = " ".join(["python -m benchmarks.chunk_variants"] + sys.argv[1:])
    table, points = rows(args.rounds, tuple(int(k) for k in args.chunks.split(",")))
    here = Path(__file__).parent
    plot_lines(here / "chunk_variants.png", {}, "gpt-mini's LM head in chunks, two ways", "measured peak (MiB)",
               "step time / gradients in the forward (median)", marks=points)
    head = ["# LM head chunks: gradients in the forward or logits recomputed in the backward", "",
            f"Machine: {machine}, torch {torch.__version__}. Command: `{command}`.", "",
            __doc__.split("\n\n", 2)[2].strip(), "", "![Measured peak and step time of each way](chunk_variants.png)", ""]
    write_rows(here / "chunk_variants.md", head, HEADER, [table])


if __name__ == "__main__":
    main()
