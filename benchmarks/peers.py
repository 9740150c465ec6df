"""Measured: optremat against no rematerialization, per-block `torch.utils.checkpoint` and
PyTorch's `activation_memory_budget` (under `torch.compile`), at equal measured peak.

    python -m benchmarks.peers [--models gpt-mini,resnet-mini] [--torch-budgets 0.5,0.1] [--runs 5] [--limit 10]

Writes benchmarks/peers.md. Rockmate is tried too and reported as skipped, with the
reason, when it does not import or run here.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import numpy as np

from benchmarks.report import machine, table
from optremat import keep_all, plan, simulate
from optremat.bench import Measured, compare
from optremat.core.graph import format_bytes
from optremat.models import build
from optremat.plots import plot_lines

HERE = Path(__file__).parent


def rockmate_status() -> str:
    """Why Rockmate is not in the tables (it needs CUDA and a working install)."""
    try:
        importlib.import_module("rockmate")
    except Exception as error:  # any import failure is the reason to print
        return f"Rockmate skipped: `import rockmate` fails ({type(error).__name__}: {error}); `pip install rockmate`"
    return ("Rockmate skipped: it imports, but Rockmate 2.0 hard-codes `torch.device(\"cuda\")` and this machine "
            "has no GPU")


def models_section(names: list[str], torch_budgets: tuple[float, ...], fractions: tuple[float, ...], runs: int,
                   limit: float, results: dict[str, list[Measured]] | None = None) -> tuple[str, str]:
    """(every method measured, the equal-peak comparison) as markdown tables."""
    all_header = ["model", "method", "vs", "measured peak", "of unplanned", "predicted peak", "overhead (measured)",
                  "overhead (predicted)", "step s", "plan/compile s"]
    all_rows, equal_rows = [], []
    for name in names:
        example = build(name)

        def report(r: Measured) -> None:
            print(f"  {name}: {r.method}{f' @ {r.matches}' if r.matches else ''}: "
                  + (r.note or f"peak {format_bytes(r.peak_bytes)}, overhead {r.overhead:+.1%}"), flush=True)

        measured = compare(example.model, example.inputs, example.loss_fn, torch_budgets=torch_budgets,
                           fractions=fractions, runs=runs, time_limit=limit, report=report)
        if results is not None:
            results[name] = measured
        unplanned = measured[0].peak_bytes
        peers = {r.method: r for r in measured if r.matches is None}
        for r in measured:
            method = r.method if r.matches is None else f"optremat @ {r.matches}"
            if not r.ran:
                all_rows.append([name, method, r.baseline, r.note] + ["-"] * 6)
                continue
            all_rows.append([name, method, r.baseline, format_bytes(r.peak_bytes), f"{r.peak_bytes / unplanned:.0%}",
                             "-" if r.predicted_peak_bytes is None else format_bytes(r.predicted_peak_bytes),
                             f"{r.overhead:+.1%}",
                             "-" if r.predicted_overhead is None else f"{r.predicted_overhead:+.1%}",
                             f"{r.step_seconds:.3f}", f"{r.setup_seconds:.1f}"])
            peer = peers.get(r.matches or "")
            if peer is not None and peer.ran:
                equal_rows.append([name, peer.method, format_bytes(peer.peak_bytes), f"{peer.overhead:+.1%} vs "
                                   f"{peer.baseline}", f"{peer.step_seconds:.3f}", format_bytes(r.peak_bytes),
                                   f"{r.overhead:+.1%}", f"{r.predicted_overhead:+.1%}", f"{r.step_seconds:.3f}",
                                   verdict(peer, r)])
        for r in measured:
            if r.matches is not None and not r.ran and r.matches in peers:
                peer = peers[r.matches]
                equal_rows.append([name, r.matches, format_bytes(peer.peak_bytes), f"{peer.overhead:+.1%}",
                                   f"{peer.step_seconds:.3f}", r.note, "-", "-", "-", "peer"])
    equal_header = ["model", "peer", "peer peak", "peer overhead", "peer step s", "optremat peak",
                    "optremat overhead", "optremat predicted", "optremat step s", "lower overhead at ≤ peak"]
    return table(all_header, all_rows), table(equal_header, equal_rows)


def verdict(peer: Measured, planned: Measured) -> str:
    """Who has the lower measured overhead at no more than the peer's measured peak."""
    if planned.peak_bytes > peer.peak_bytes:
        return "peer (optremat over its peak)"
    return "optremat" if planned.overhead < peer.overhead else "peer"


def losses_sentence(results: dict[str, list[Measured]]) -> str:
    """The comparisons at equal peak that optremat loses, as a sentence for the results."""
    lost = losses(results)
    if not lost:
        return "optremat has the lower overhead in every comparison at equal peak."
    return f"optremat has the higher overhead in {len(lost)} of these comparisons: " + "; ".join(lost) + "."


def losses(results: dict[str, list[Measured]]) -> list[str]:
    """The comparisons optremat loses, one phrase each."""
    found = []
    for name, measured in results.items():
        peers = {r.method: r for r in measured if r.matches is None}
        for r in measured:
            peer = peers.get(r.matches or "")
            if peer is not None and peer.ran and (not r.ran or verdict(peer, r) != "optremat"):
                found.append(f"{name} against {peer.method} ({peer.overhead:+.1%} vs optremat "
                             + (f"{r.overhead:+.1%})" if r.ran else "infeasible)"))
    return found


def memory_plot(name: str, fraction: float, limit: float, path: Path) -> str:
    """Memory over (simulated) time of the unplanned step and of one plan; returns a caption."""
    example = build(name)
    planned = plan(example.model, example.inputs, fraction, loss_fn=example.loss_fn, time_limit=limit)
    graph = planned.graph
    lines = {}
    for label, schedule in (("unplanned", keep_all(graph)), (f"plan at {fraction:.0%} ({planned.solver})",
                                                            planned.schedule)):
        result = simulate(graph, schedule)
        clock = np.cumsum(graph.cost[schedule.node]) * 1e3
        lines[label] = list(zip(clock.tolist(), (result.curve / 2**20).tolist()))
    plot_lines(path, lines, f"{name}: live memory over the step (simulated)", "time (ms, cost model)", "MiB")
    return (f"`{path.name}`: live memory of {name}'s step, unplanned and planned at {fraction:.0%} of its peak "
            f"(predicted peak {format_bytes(planned.predicted_peak_bytes)}, overhead {planned.predicted_overhead:.1%}).")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt-mini,resnet-mini")
    parser.add_argument("--torch-budgets", default="0.5,0.1")
    parser.add_argument("--fractions", default="0.5,0.3")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--limit", type=float, default=10.0)
    args = parser.parse_args()
    measured: dict[str, list[Measured]] = {}
    every, equal = models_section(args.models.split(","), tuple(float(b) for b in args.torch_budgets.split(",")),
                                  tuple(float(f) for f in args.fractions.split(",")), args.runs, args.limit, measured)
    equal += "\n\n" + losses_sentence(measured)
    out = HERE / "peers.md"
    command = (f"python -m benchmarks.peers --models {args.models} --torch-budgets {args.torch_budgets} "
               f"--fractions {args.fractions} --runs {args.runs} --limit {args.limit:g}")
    out.write_text(f"# Measured against peers\n\nMachine: {machine()}. Command: `{command}`.\n\n{rockmate_status()}"
                   f"\n\n{equal}\n\n{every}\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
