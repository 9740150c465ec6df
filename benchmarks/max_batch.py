"""Largest batch that fits a memory size, unplanned vs planned (solver "auto", overhead cap).

    python -m benchmarks.max_batch [--cases gpt-small:16GiB,resnet:16GiB] [--max-overhead 0.25] [--limit 10]

Graphs at each batch come from two fake-tensor traces (batch 1 and 2); nothing is
allocated at the searched sizes. Writes benchmarks/max_batch.md.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from benchmarks.planners import write_results
from optremat import extract
from optremat.batch import graph_at, max_batch
from optremat.budget import parse_size
from optremat.models import build

OUT = Path(__file__).with_name("max_batch.md")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="gpt-small:16GiB,resnet:16GiB")
    parser.add_argument("--max-overhead", type=float, default=0.25)
    parser.add_argument("--limit", type=float, default=10.0, help="solver seconds per batch size tried")
    args = parser.parse_args()
    header = ["model", "memory", "unplanned batch", "planned batch", "ratio", "planned overhead", "search s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for case in args.cases.split(","):
        name, memory = case.split(":")
        started = time.perf_counter()
        graphs = []
        for batch in (1, 2):
            example = build(name, batch=batch)
            graphs.append(extract(example.model, example.inputs, example.loss_fn))
        result = max_batch(graph_at(graphs[0], graphs[1], 1, 2), parse_size(memory), max_overhead=args.max_overhead,
                           time_limit=args.limit)
        cells = [name, memory, str(result.unplanned), str(result.planned), f"{result.ratio:.2f}x",
                 f"{result.planned_overhead:.1%}", f"{time.perf_counter() - started:.0f}"]
        print("  ".join(cells), flush=True)
        lines.append("| " + " | ".join(cells) + " |")
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    OUT.write_text("# Max batch: unplanned vs planned\n\n"
                   f"Machine: {machine}. Command: `python -m benchmarks.max_batch --cases {args.cases} "
                   f"--max-overhead {args.max_overhead} --limit {args.limit:g}`. Peaks are simulated on every op "
                   "(parameters and gradients included); a planned batch's schedule (run as it is by the exact runtime) "
                   "must fit with at most the overhead cap of extra compute (roofline costs, interpolated across batch "
                   "sizes).\n\n" + "\n".join(lines) + "\n")
    print(f"wrote {OUT}")
    write_results()


if __name__ == "__main__":
    main()
