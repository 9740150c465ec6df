"""The `optremat` command line.

Exit codes: 0 success, 2 bad input (unknown model, unreadable file, untraceable model,
a budget or solver not understood), 3 infeasible budget (the message names the smallest
feasible one).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

from optremat.budget import InfeasibleBudget
from optremat.coarsen import coarsen
from optremat.graph import Graph, GraphError, format_bytes
from optremat.schedule import keep_all, simulate
from optremat.solve import SOLVERS

EXIT_BAD_INPUT = 2
EXIT_INFEASIBLE = 3


def _load(args: argparse.Namespace) -> tuple[Graph, str]:
    if args.graph:
        return Graph.load(args.graph), args.graph
    from optremat.extract import extract
    from optremat.models import build

    example = build(args.model)
    return extract(example.model, example.inputs, example.loss_fn, device=args.device), f"built-in model {args.model}"


def _graph_command(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    graph, source = _load(args)
    seconds = time.perf_counter() - start
    coarse = coarsen(graph, by_module=args.by_module)
    unplanned = simulate(graph, keep_all(graph))
    coarse_peak = simulate(coarse.coarse, keep_all(coarse.coarse)).peak_bytes
    if args.save:
        graph.save(args.save)
    if args.json:
        print(json.dumps({
            "source": source, "nodes": graph.n, "edges": len(graph.edges), "coarse_nodes": coarse.coarse.n,
            "unplanned_peak_bytes": unplanned.peak_bytes, "coarse_unplanned_peak_bytes": coarse_peak,
            "resident_bytes": graph.pinned_bytes, "step_cost_seconds": graph.total_cost,
            "extract_seconds": seconds, "fingerprint": graph.fingerprint,
        }))
        return 0
    print(f"{source} (fingerprint {graph.fingerprint}, read in {seconds:.1f} s)")
    print(graph.summary())
    print(f"unplanned peak {format_bytes(unplanned.peak_bytes)} (simulated)")
    print(f"coarsened{' by module' if args.by_module else ''}: {coarse.coarse.n} nodes "
          f"({graph.n / max(coarse.coarse.n, 1):.1f}x fewer), unplanned peak {format_bytes(coarse_peak)}")
    if args.save:
        print(f"graph written to {args.save}")
    return 0


def _plan_command(args: argparse.Namespace) -> int:
    from optremat.budget import resolve_budget
    from optremat.solve import solve

    graph, source = _load(args)
    coarse = None if args.graph else coarsen(graph)
    if coarse is not None:
        graph = coarse.fine
    planned = graph if coarse is None else coarse.coarse
    budget = resolve_budget(graph, _budget(args.budget))

    def progress(elapsed: float, cost: float, bound: float) -> None:
        print(f"  {elapsed:7.1f} s  overhead {cost / planned.total_cost - 1:8.2%}  "
              f"bound {bound / planned.total_cost - 1:8.2%}", file=sys.stderr, flush=True)

    solution = solve(planned, budget, solver=args.solver, time_limit=args.time_limit, workers=args.workers,
                     seed=args.seed, deterministic=args.deterministic, progress=progress if args.progress else None)
    schedule = solution.schedule if coarse is None else coarse.expand(solution.schedule)
    result = simulate(graph, schedule)
    unplanned = simulate(graph, keep_all(graph))
    if result.peak_bytes > budget:
        print(f"optremat: warning: on every op the plan peaks at {format_bytes(result.peak_bytes)}, over the budget: "
              "the coarse graph undercounts this model's storage", file=sys.stderr)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(schedule.to_json(), f)
    report = {
        "source": source, "nodes": graph.n, "planned_nodes": planned.n, "solver": solution.solver,
        "status": solution.status, "budget_bytes": budget, "peak_bytes": result.peak_bytes,
        "unplanned_peak_bytes": unplanned.peak_bytes, "overhead": result.overhead,
        "lower_bound_overhead": None if solution.lower_bound is None else solution.lower_bound / planned.total_cost - 1,
        "gap": solution.gap, "recomputations": result.recomputations, "solve_seconds": solution.seconds,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{source}: {graph.n} nodes" + ("" if args.graph else f", planned on {planned.n} coarse nodes"))
    print(f"budget {format_bytes(budget)}: peak {format_bytes(result.peak_bytes)} "
          f"(unplanned {format_bytes(unplanned.peak_bytes)}), overhead {result.overhead:.2%}, "
          f"{result.recomputations} recomputations")
    bound = report["lower_bound_overhead"]
    proof = "" if bound is None else f", proven overhead >= {bound:.2%} (gap {solution.gap:.2%})"
    print(f"{solution.solver}: {solution.status}{proof}, {solution.seconds:.2f} s")
    if args.save:
        print(f"schedule written to {args.save}")
    return 0


def _budget(text: str) -> int | float | str:
    """A CLI budget: digits alone are bytes, a number with a point a fraction, else a size."""
    if text.isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def _add_source(command: argparse.ArgumentParser, models: list[str]) -> None:
    source = command.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=models, help="a built-in model")
    source.add_argument("--graph", help="a graph file (optremat JSON or a published node-link benchmark graph)")
    command.add_argument("--device", default="cpu", help="device profile for roofline costs (cpu, a100, h100)")


def _parser() -> argparse.ArgumentParser:
    from optremat.models import BUILDERS

    parser = argparse.ArgumentParser(prog="optremat", description="Activation rematerialization planning for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    graph = commands.add_parser("graph", help="extract (or load) a training-step graph and summarise it")
    _add_source(graph, sorted(BUILDERS))
    graph.add_argument("--by-module", action="store_true", help="also group consecutive ops of one module")
    graph.add_argument("--save", help="write the extracted graph as JSON")
    graph.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    graph.set_defaults(run=_graph_command)
    plan = commands.add_parser("plan", help="plan rematerialization under a memory budget")
    _add_source(plan, sorted(BUILDERS))
    plan.add_argument("--budget", required=True,
                      help="bytes (123456789), a size (6GiB, 500MB) or a fraction of the unplanned peak (0.5)")
    plan.add_argument("--solver", default="auto", choices=SOLVERS)
    plan.add_argument("--time-limit", type=float, default=30.0, help="seconds for the exact solvers")
    plan.add_argument("--workers", type=int, default=0, help="solver threads (0: all cores)")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--deterministic", action="store_true", help="reproducible solver runs")
    plan.add_argument("--progress", action="store_true", help="print each improving plan and bound to stderr")
    plan.add_argument("--save", help="write the schedule as JSON")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    plan.set_defaults(run=_plan_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from optremat.extract import ExtractionError

    try:
        return args.run(args)
    except InfeasibleBudget as error:
        print(f"optremat: infeasible: {error}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except TimeoutError as error:
        print(f"optremat: no plan: {error}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except (GraphError, ExtractionError, OSError, ValueError, KeyError) as error:
        print(f"optremat: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
