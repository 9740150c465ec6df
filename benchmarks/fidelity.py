"""Simulated vs measured peak of the unplanned training step on the built-in models.

    python -m benchmarks.fidelity [--models gpt-tiny,resnet,...]

Prints a table and writes benchmarks/fidelity.md; numbers are CPU-measured (profiler
memory events) against simulate() of the keep-everything schedule.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from optremat import extract, keep_all, simulate
from optremat.core.coarsen import coarsen
from optremat.core.graph import format_bytes
from optremat.models import BUILDERS, build
from optremat.runtime.measure import measure_step

OUT = Path(__file__).with_name("fidelity.md")


def row(name: str) -> list[str]:
    example = build(name)
    start = time.perf_counter()
    graph = extract(example.model, example.inputs, example.loss_fn)
    seconds = time.perf_counter() - start
    measured = measure_step(example.model, example.inputs, example.loss_fn).peak_bytes
    predicted = simulate(graph, keep_all(graph)).peak_bytes
    fused, by_module = coarsen(graph).coarse.n, coarsen(graph, by_module=True).coarse.n
    return [name, f"{seconds:.1f}", str(graph.n), str(fused), str(by_module), format_bytes(predicted),
            format_bytes(measured), f"{measured / predicted - 1:+.1%}"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=",".join(sorted(BUILDERS)))
    names = parser.parse_args().models.split(",")
    header = ["model", "extract s", "nodes", "coarse nodes", "by module", "simulated peak", "measured peak", "error"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in names:
        cells = row(name)
        print("  ".join(cells), flush=True)
        lines.append("| " + " | ".join(cells) + " |")
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    OUT.write_text("# Unplanned-step fidelity: simulate() vs measured CPU peak\n\n"
                   f"Machine: {machine}. Command: `python -m benchmarks.fidelity`.\n\n" + "\n".join(lines) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
