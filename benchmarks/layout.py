"""Arena size vs the live-bytes bound (how much a real address layout loses to
fragmentation), what sharing storage with dying inputs saves, and what choosing the
execution order saves.

    python -m benchmarks.layout [--models gpt-small,resnet,unet,vgg] [--fraction 0.7] [--limit 10]

For each model, the unplanned schedule and the `auto` plan at `fraction` of the unplanned
peak (planned on the coarse graph, run on every op): the most bytes live at once, and
the arena the greedy-by-size and CP-SAT layouts need. Writes benchmarks/layout.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.report import machine, table
from optremat import Graph, InfeasibleBudget, Schedule, extract, keep_all, resolve_budget, simulate, solve
from optremat.core.coarsen import coarsen
from optremat.core.graph import format_bytes
from optremat.core.order import best_order
from optremat.ilp.cpsat import min_peak_cpsat
from optremat.ilp.layout import allocations, cpsat_layout, greedy_layout
from optremat.models import build

HERE = Path(__file__).parent
SHARE_MODELS = ("gpt-tiny", "resnet-tiny", "unet-tiny", "rnn-tiny")
"""Models small enough to plan on every op, where sharing is a solver decision."""


def section(names: list[str], fraction: float, limit: float) -> str:
    header = ["model", "schedule", "allocations", "live bytes (bound)", "greedy arena", "cpsat arena", "cpsat status, s",
              "peak with share (saving)"]
    rows = []
    for name in names:
        example = build(name)
        coarsened = coarsen(extract(example.model, example.inputs, example.loss_fn))
        graph = coarsened.fine
        schedules = [("unplanned", keep_all(graph))]
        try:
            solution = solve(coarsened.coarse, resolve_budget(graph, fraction), "auto", time_limit=limit)
            schedules.append((f"auto at {fraction:.0%}", coarsened.expand(solution.schedule)))
        except (InfeasibleBudget, TimeoutError) as error:
            rows.append([name, f"auto at {fraction:.0%}", str(error).split(";")[0]] + ["-"] * 5)
        for label, schedule in schedules:
            found = allocations(graph, schedule)
            greedy = greedy_layout(found)
            exact = cpsat_layout(found, time_limit=limit, hint=greedy)
            rows.append([name, label, str(len(found)), format_bytes(greedy.live_bytes),
                         f"{format_bytes(greedy.arena_bytes)} ({greedy.fragmentation:+.2%})",
                         f"{format_bytes(exact.arena_bytes)} ({exact.fragmentation:+.2%})",
                         f"{exact.status}, {exact.seconds:.1f}", _shared_peak(graph, schedule)])
            print("  ".join(rows[-1]), flush=True)
    return table(header, rows)


def _shared_peak(graph: Graph, schedule: Schedule) -> str:
    """The schedule's peak when pointwise ops write over inputs they are the last to read."""
    plain, shared = simulate(graph, schedule).peak_bytes, simulate(graph, schedule, share=True)
    return (f"{format_bytes(shared.peak_bytes)} ({1 - shared.peak_bytes / plain:.2%}, "
            f"{len(shared.shared)} ops share)")


def share_section(names: list[str], fraction: float, limit: float) -> str:
    """Sharing as a solver decision, on every op of small models (coarsening folds the
    pointwise ops that could share into their producers, so it is measured on the fine
    graph): CP-SAT's least peak (the run with sharing hinted with the plan without) and
    `auto`'s overhead at `fraction`, without and with."""
    header = ["model", "ops (may share)", "least peak", "with share", f"auto at {fraction:.0%}", "with share"]
    rows = []
    for name in names:
        example = build(name)
        graph = extract(example.model, example.inputs, example.loss_fn)
        unplanned = simulate(graph, keep_all(graph)).peak_bytes
        row = [name, f"{graph.n} ({int((graph.shareable >= 0).sum())})"]
        least, overhead, hint = [], [], None
        for share in (False, True):
            smallest = min_peak_cpsat(graph, time_limit=limit, share=share, hint=hint)
            hint = smallest.schedule
            peak = simulate(graph, smallest.schedule, share=frozenset(smallest.shared)).peak_bytes
            least.append(f"{peak / unplanned:.1%} ({smallest.status.lower()})")
            try:
                solution = solve(graph, int(unplanned * fraction), "auto", time_limit=limit, share=share)
                overhead.append(f"{solution.cost / graph.total_cost - 1:.2%} ({len(solution.shared)} shared)")
            except InfeasibleBudget:
                overhead.append("infeasible")
            except TimeoutError:
                overhead.append("no plan in time")
        rows.append(row + least + overhead)
        print("  ".join(rows[-1]), flush=True)
    return table(header, rows)


def order_section(names: list[str], fraction: float, limit: float) -> str:
    """Unplanned peak and the `auto` plan's overhead at a fixed budget, traced order vs
    the order `best_order` picks."""
    header = ["model", "unplanned peak, traced", "reordered", f"auto at {fraction:.0%}, traced", "reordered"]
    rows = []
    for name in names:
        example = build(name)
        traced = extract(example.model, example.inputs, example.loss_fn)
        budget = resolve_budget(traced, fraction)
        unplanned = simulate(traced, keep_all(traced)).peak_bytes
        row = [name]
        results = []
        for graph in (traced, best_order(traced)[0]):
            row.append(format_bytes(simulate(graph, keep_all(graph)).peak_bytes))
            coarsened = coarsen(graph)
            try:
                solution = solve(coarsened.coarse, budget, "auto", time_limit=limit)
                results.append(f"{simulate(coarsened.fine, coarsened.expand(solution.schedule)).overhead:.1%}")
            except InfeasibleBudget as error:
                results.append(f"infeasible (min {error.smallest / unplanned:.0%})")
            except TimeoutError:
                results.append("no plan in time")
        rows.append(row + results)
        print("  ".join(rows[-1]), flush=True)
    return table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt-small,resnet,unet,vgg")
    parser.add_argument("--fraction", type=float, default=0.7)
    parser.add_argument("--limit", type=float, default=10.0)
    args = parser.parse_args()
    names = args.models.split(",")
    text = "\n\n".join([section(names, args.fraction, args.limit), share_section(list(SHARE_MODELS), 0.9, args.limit),
                        order_section(names, args.fraction, args.limit)])
    out = HERE / "layout.md"
    out.write_text(f"# Memory layout and execution order\n\nMachine: {machine()}.\n\n{text}\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
