"""A causal LM's head chunked by the plan: optremat's joint choice of LM head chunks and
checkpointed module calls against per-block checkpointing, with and without PyTorch's
own chunked `linear_cross_entropy`.

    python -m benchmarks.chunked [--rounds 9] [--limit 20]

The model is gpt-mini's shape (`optremat.models.GPT`: vocabulary 8192, 256 tokens, width
256, 4 blocks, batch 4) returning its final hidden states; the loss is
`optremat.CausalLMLoss` over its tied head. Rows: the unplanned step with the whole head;
per-block checkpointing (non-reentrant `torch.utils.checkpoint` around every block) with
the whole head, and with the head and loss in `F.linear_cross_entropy` under PyTorch's
default `LinearCrossEntropyOptions()` (its own chunk size); optremat planned with
`chunks="auto"` at per-block checkpointing's measured peak and at 85%, 70% and 55% of it.
The least peak of any region plan with the whole head and with the chunks optremat
prices is stated above the table (proven by the exact search). Step times as
`benchmarks.native` measures them: every configuration in the same process over `rounds`
rounds after one uncounted warm-up round, in a shuffled order each round, each right
after an unplanned step; the overhead is the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import optremat
from benchmarks.native import _time
from benchmarks.report import write_rows
from optremat.bench import checkpointed_blocks, under
from optremat.core.graph import format_bytes
from optremat.models import HiddenGPT
from optremat.runtime.measure import measure_peak

HEADER = ["method", "budget", "head", "module calls checkpointed", "predicted peak", "measured peak",
          "measured / predicted", "predicted overhead", "measured overhead (median)", "plan s"]
SHAPE = dict(vocab=8192, seq=256, dim=256, layers=4, heads=4)
BATCH = 4


def torch_chunked(head: nn.Module, labels: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The shifted causal LM loss in `F.linear_cross_entropy` with PyTorch's default chunking."""
    shifted = F.pad(labels[..., 1:], (0, 1), value=-100).reshape(-1)

    def loss(hidden: torch.Tensor) -> torch.Tensor:
        return F.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight, shifted,
                                      options=nn.LinearCrossEntropyOptions())

    return loss


def rows(rounds: int, limit: float) -> tuple[list[str], list[list[str]]]:
    torch.manual_seed(0)
    model = HiddenGPT(**SHAPE)
    idx = torch.randint(0, SHAPE["vocab"], (BATCH, SHAPE["seq"]))
    labels = torch.randint(0, SHAPE["vocab"], (BATCH, SHAPE["seq"]))
    whole, auto = optremat.CausalLMLoss(model.head, labels, chunks=None), optremat.CausalLMLoss(model.head, labels)
    params = list(model.parameters())

    def step_of(loss_fn: Callable[[Any], torch.Tensor]) -> Callable[[], tuple]:
        return lambda: torch.autograd.grad(loss_fn(model(idx)), params)

    def measured(run: Callable[[], Any]) -> int:
        run()
        return measure_peak(run, resident=[params, idx]).peak_bytes

    def per_block(step: Callable[[], tuple]) -> Callable[[], tuple]:
        def run() -> tuple:
            with checkpointed_blocks(model, [f"blocks.{i}" for i in range(SHAPE["layers"])]):
                return step()
        return run

    methods: dict[str, tuple[Callable[[], Any] | None, dict[str, str]]] = {}
    step = step_of(whole)
    methods["unplanned"] = (step, {"method": "unplanned", "head": "whole",
                                   "measured peak": format_bytes(measured(step))})
    blocks = per_block(step)
    block_peak = measured(blocks)
    methods["per-block"] = (blocks, {"method": "per-block checkpoint", "head": "whole",
                                     "measured peak": format_bytes(block_peak)})
    lce = per_block(step_of(torch_chunked(model.head, labels)))
    methods["per-block + lce"] = (lce, {"method": "per-block checkpoint + F.linear_cross_entropy", "head":
                                        "LinearCrossEntropyOptions()", "measured peak": format_bytes(measured(lce))})
    floors = []
    for name, loss_fn in (("whole head", whole), ("chunks priced", auto)):
        try:  # a budget no plan meets, above the parameters and gradients every step holds
            optremat.plan(model, (idx,), int(block_peak * 0.3), loss_fn=loss_fn, time_limit=limit)
        except optremat.InfeasibleBudget as error:
            floors.append(f"least peak of any region plan, {name}: {format_bytes(error.smallest)}"
                          f"{' (proven)' if error.proven else ''}")
    for label, budget in [("= per-block", block_peak)] + [(f"{f:.0%} of per-block", int(block_peak * f))
                                                          for f in (0.85, 0.7, 0.55)]:
        started = time.perf_counter()
        try:
            plan = optremat.plan(model, (idx,), budget, loss_fn=auto, time_limit=limit)
        except optremat.InfeasibleBudget as error:
            methods[label] = (None, {"method": "optremat", "budget": label,
                                     "predicted peak": f"infeasible (smallest {format_bytes(error.smallest)})"})
            continue
        seconds = time.perf_counter() - started
        planned = under(model, plan, step_of(auto))
        peak = measured(planned)
        chunks = plan.chunking.chunks
        methods[label] = (planned, {
            "method": "optremat", "budget": f"{label} ({format_bytes(budget)})",
            "head": "whole" if chunks is None else f"{chunks} chunks",
            "module calls checkpointed": str(len(plan.regions)),
            "predicted peak": format_bytes(plan.predicted_peak_bytes), "measured peak": format_bytes(peak),
            "measured / predicted": f"{peak / plan.predicted_peak_bytes:.3f}",
            "predicted overhead": f"{plan.predicted_overhead:+.1%}", "plan s": f"{seconds:.1f}"})
    _time(methods, rounds, "cpu")
    return floors, [[fields.get(column, "-") for column in HEADER] for _, fields in methods.values()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--limit", type=float, default=20.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread, no GPU"
    command = " ".join(["python -m benchmarks.chunked"] + sys.argv[1:])
    floors, table = rows(args.rounds, args.limit)
    head = ["# LM head chunks chosen with the region plan", "",
            f"Machine: {machine}, torch {torch.__version__}. Command: `{command}`.", "",
            __doc__.split("\n\n", 2)[2].strip(), "", *[f"- {line}" for line in floors], ""]
    write_rows(Path(__file__).with_name("chunked.md"), head, HEADER, [table])


if __name__ == "__main__":
    main()
