"""Largest batch that fits a memory size: built-in models (unplanned vs planned within an
overhead cap) and the reproduction of Checkmate's VGG19 result on its published graph.

    python -m benchmarks.max_batch [--cases gpt-small:16GiB,gpt-small+chunks:16GiB,resnet:16GiB]
                                   [--max-overhead 0.25] [--limit 10]

Graphs at each batch come from two fake-tensor traces (batch 1 and 2); nothing is
allocated at the searched sizes. A GPT named with "+chunks" returns its hidden states
and its head and loss run in `optremat.CausalLMLoss`, priced whole and in each token
chunk count (each traced), the cheapest plan that fits taken. Writes
benchmarks/max_batch.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.report import machine, table
from optremat import InfeasibleBudget, keep_all, simulate
from optremat.core import published
from optremat.core.budget import parse_size
from optremat.heuristics import NotAChain
from optremat.ilp.cpsat import min_peak_cpsat
from optremat.planners.batch import max_batch
from optremat.planners.solve import HEURISTICS
from optremat.planning.batch import batch_ways

OUT = Path(__file__).with_name("max_batch.md")
CHUNKED = "+chunks"
"""A case's model name ends in this for its LM head priced whole and in token chunks."""
CHECKMATE_VGG19 = {"checkpoint all": 167, "chen": 197, "ilp": 289}
"""Checkmate (MLSys 2020): VGG19 batch that fits one fixed memory, per strategy."""


def models_section(cases: list[tuple[str, str]], max_overhead: float, limit: float,
                   found: dict[str, tuple[int, int, float]] | None = None) -> str:
    """Max batch per model and memory size (a name ending in CHUNKED: a GPT's head and
    loss priced whole and in token chunks); `found` receives (unplanned, planned,
    overhead) per model."""
    header = ["model", "memory", "unplanned batch", "planned batch", "ratio", "planned overhead", "LM head",
              "search s"]
    rows = []
    for name, memory in cases:
        started = time.perf_counter()
        ways = batch_ways(name.removesuffix(CHUNKED), name.endswith(CHUNKED))
        result = max_batch(ways[0][1], parse_size(memory), max_overhead=max_overhead, time_limit=limit,
                           alternatives=ways[1:])
        head = "-" if len(ways) == 1 else result.planned_with or "whole"
        rows.append([name, memory, str(result.unplanned), str(result.planned), f"{result.ratio:.2f}x",
                     f"{result.planned_overhead:.1%}", head, f"{time.perf_counter() - started:.0f}"])
        if found is not None:
            found[name] = (result.unplanned, result.planned, result.planned_overhead)
        print("  ".join(rows[-1]), flush=True)
    return table(header, rows)


def vgg19_section(folder: Path, limit: float) -> str:
    """Checkmate's VGG19 max-batch result on its own graph (batch 256).

    Every tensor of the published graph scales with the batch (it holds no parameters),
    so a strategy's largest batch at a fixed memory is that memory over its least peak
    per sample. The memory is set where keeping everything fits 167, as in the paper;
    each strategy's least peak is what it reaches at any overhead.
    """
    graph = published.load(folder / "vgg19_b256_224x224_train.json")
    unplanned = simulate(graph, keep_all(graph)).peak_bytes
    memory = unplanned * CHECKMATE_VGG19["checkpoint all"] / 256
    header = ["strategy", "least peak at batch 256", "batch that fits", "published batch", "overhead at least peak"]
    rows = [["checkpoint all (no remat)", f"{unplanned / 2**30:.2f} GiB", str(CHECKMATE_VGG19["checkpoint all"]),
             str(CHECKMATE_VGG19["checkpoint all"]), "0.0%"]]
    for name in HEURISTICS:
        try:
            HEURISTICS[name](graph, 0)
        except InfeasibleBudget as error:
            peak = error.smallest
        except NotAChain:
            rows.append([name, "n/a (no backward)", "-", "-", "-"])
            continue
        listed = str(CHECKMATE_VGG19["chen"]) if name == "chen" else "-"
        rows.append([name, f"{peak / 2**30:.2f} GiB", str(int(memory * 256 // peak)), listed, "-"])
    solution = min_peak_cpsat(graph, time_limit=limit)
    peak = simulate(graph, solution.schedule).peak_bytes
    rows.append([f"cpsat least peak ({solution.status.lower()}, {solution.seconds:.1f} s)",
                 f"{peak / 2**30:.2f} GiB", str(int(memory * 256 // peak)), f"{CHECKMATE_VGG19['ilp']} (ilp)",
                 f"{solution.cost / graph.total_cost - 1:.1%}"])
    for row in rows:
        print("  ".join(row), flush=True)
    return table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="gpt-small:16GiB,gpt-small+chunks:16GiB,resnet:16GiB")
    parser.add_argument("--max-overhead", type=float, default=0.25)
    parser.add_argument("--limit", type=float, default=10.0, help="solver seconds per batch size tried")
    args = parser.parse_args()
    cases = [tuple(case.split(":")) for case in args.cases.split(",")]
    text = models_section(cases, args.max_overhead, args.limit)
    OUT.write_text("# Max batch: unplanned vs planned\n\n"
                   f"Machine: {machine()}. Command: `python -m benchmarks.max_batch --cases {args.cases} "
                   f"--max-overhead {args.max_overhead} --limit {args.limit:g}`. Peaks are simulated on every op "
                   "(parameters and gradients included); a planned batch's schedule (run as it is in compiled graphs) "
                   "must fit with at most the overhead cap of extra compute (roofline costs, interpolated across batch "
                   "sizes). A \"+chunks\" row's plans put the LM head in chunks under that op-level schedule: "
                   "simulated only, as no compiled step with the head in chunks was run.\n\n" + text + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
