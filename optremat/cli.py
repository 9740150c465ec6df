"""The `optremat` command line.

Exit codes: 0 success, 2 bad input (unknown model, unreadable or malformed file, a model
file or function that fails, untraceable model, a budget, solver or option not
understood, a file that cannot be written), 3 infeasible budget (the message names the
smallest feasible one) or a `max-batch` memory that not even batch 1 fits. Errors are
one line on stderr, `optremat: error: ...`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from optremat.core import published
from optremat.core.budget import InfeasibleBudget
from optremat.core.coarsen import coarsen
from optremat.core.graph import Graph, GraphError, format_bytes
from optremat.core.schedule import keep_all, peak_floor, simulate
from optremat.planners.solve import SOLVERS

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "optremat"
EXIT_BAD_INPUT = 2
EXIT_INFEASIBLE = 3


def _load(args: argparse.Namespace) -> tuple[Graph, str]:
    if args.graph:
        return published.load(args.graph), args.graph
    from optremat.models import load
    from optremat.tracing.extract import extract

    example = load(args.model)
    return extract(example.model, example.inputs, example.loss_fn, device=args.device), f"model {args.model}"


def _graph_command(args: argparse.Namespace) -> int:
    _check_source(args)
    _check_target(args.save, "--save")
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
    def progress(elapsed: float, cost: float, bound: float, total: float) -> None:
        print(f"  {elapsed:7.1f} s  overhead {cost / total - 1:8.2%}  bound {bound / total - 1:8.2%}",
              file=sys.stderr, flush=True)

    _check_plan_options(args)
    if args.model is not None:
        if args.share:
            raise ValueError("--share is for --graph files: a model's plan runs its module calls under checkpoint, "
                             "which cannot write over inputs (compiled graphs can: optremat.compile_backend)")
        return _plan_model(args, progress)
    from optremat.core.budget import resolve_budget
    from optremat.planners.solve import solve
    from optremat.planning.result import write_atomically

    graph = published.load(args.graph)
    budget = resolve_budget(graph, args.budget)
    solution = solve(graph, budget, solver=args.solver, time_limit=args.time_limit, workers=args.workers,
                     seed=args.seed, deterministic=args.deterministic, share=args.share,
                     progress=(lambda e, c, b: progress(e, c, b, graph.total_cost)) if args.progress else None)
    result = simulate(graph, solution.schedule, share=frozenset(solution.shared))
    unplanned = simulate(graph, keep_all(graph))
    schedule = {**solution.schedule.to_json(), "shared": sorted(map(list, solution.shared.items()))}
    failed = _saved(lambda: write_atomically(Path(args.save), json.dumps(schedule))) if args.save else None
    report = {
        "source": args.graph, "nodes": graph.n, "solver": solution.solver, "status": solution.status,
        "budget_bytes": budget, "peak_bytes": result.peak_bytes, "unplanned_peak_bytes": unplanned.peak_bytes,
        "overhead": result.overhead,
        "lower_bound_overhead": None if solution.lower_bound is None else solution.lower_bound / graph.total_cost - 1,
        "gap": solution.gap, "recomputations": result.recomputations, "shared": len(solution.shared),
        "solve_seconds": solution.seconds,
    }
    if args.json:
        print(json.dumps(report))
        return _after_save(failed)
    print(f"{args.graph}: {graph.n} nodes")
    print(f"budget {format_bytes(budget)}: peak {format_bytes(result.peak_bytes)} "
          f"(unplanned {format_bytes(unplanned.peak_bytes)}), overhead {result.overhead:.2%}, "
          f"{result.recomputations} recomputations" + (f", {len(solution.shared)} ops write over an input" if args.share else ""))
    bound = report["lower_bound_overhead"]
    proof = "" if bound is None else f", proven overhead >= {bound:.2%} (gap {solution.gap:.2%})"
    print(f"{solution.solver}: {solution.status}{proof}, {solution.seconds:.2f} s")
    if args.save and failed is None:
        print(f"schedule written to {args.save}")
    return _after_save(failed)


def _plan_model(args: argparse.Namespace, progress: Callable) -> int:
    from optremat.models import load, own_loss_or_sum
    from optremat.planning.model import plan

    example = load(args.model)
    given = None if example.loss_fn is own_loss_or_sum else example.loss_fn  # plan's own default, LM head chunks
    result = plan(example.model, example.inputs, args.budget, solver=args.solver, time_limit=args.time_limit,
                  loss_fn=given, device=args.device,
                  workers=args.workers, seed=args.seed, deterministic=args.deterministic,
                  progress=(lambda e, c, b: progress(e, 1 + c, 1 + b, 1.0)) if args.progress else None,
                  cache=args.cache, parallel=_parallel(args))
    failed = _saved(lambda: result.save(args.save)) if args.save else None
    if args.json:
        print(json.dumps(_plan_report(args.model, result)))
        return _after_save(failed)
    print(f"model {args.model}: {result.graph.n} ops")
    print(result.summary())
    if args.save and failed is None:
        print(f"plan written to {args.save}")
    return _after_save(failed)


def _check_source(args: argparse.Namespace) -> None:
    """Refuse an empty --model or --graph before loading anything."""
    wanted = {"--model": "a built-in model or path/to/file.py:function", "--graph": "a graph file"}
    for flag, value in (("--model", args.model), ("--graph", args.graph)):
        if value is not None and not value.strip():
            raise ValueError(f"{flag} is empty; name {wanted[flag]}")


def _check_plan_options(args: argparse.Namespace) -> None:
    """Refuse what `plan` cannot serve before loading, tracing or solving anything."""
    from optremat.core.budget import check_budget
    from optremat.ilp.search import check_search

    _check_source(args)
    check_budget(args.budget)
    if not math.isfinite(args.time_limit) or args.time_limit <= 0:
        raise ValueError(f"--time-limit must be a number of seconds > 0, not {args.time_limit:g}")
    check_search(args.workers, args.seed, prefix="--")
    _check_target(args.save, "--save")


def _check_target(path: str | None, flag: str) -> None:
    """Refuse a file to write whose directory does not exist, before any work is done."""
    if path is None:
        return
    target = Path(path)
    if not target.parent.is_dir():
        raise ValueError(f"{flag} {path}: directory {target.parent} does not exist; create it or choose another path")
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a directory; name a file to write")


def _saved(write: Callable[[], None]) -> OSError | None:
    """Run `write`, returning its OSError instead of raising it, so that the result it
    could not write is still printed before the error."""
    try:
        write()
    except OSError as error:
        return error
    return None


def _after_save(failed: OSError | None) -> int:
    """Exit status 0, or the write error once the result has been printed."""
    if failed is not None:
        raise failed
    return 0


def _parallel(args: argparse.Namespace) -> Any:
    """The data-parallel job whose one rank `--fsdp` or `--ddp` (with `--world`) plans, or None."""
    from optremat.core.sharding import DDP, FSDP

    if args.fsdp is None and not args.ddp:
        if args.world is not None:
            raise ValueError("--world needs --fsdp UNITS or --ddp")
        if args.optimizer_state:
            raise ValueError("--optimizer-state is what each rank of --fsdp UNITS or --ddp holds: a single process's "
                             "optimizer state is not priced")
        return None
    if args.fsdp is not None and args.ddp:
        raise ValueError("choose one of --fsdp and --ddp")
    if args.world is None:
        raise ValueError("--fsdp and --ddp need --world, the number of ranks")
    if args.ddp:
        return DDP(world=args.world, optimizer_state=args.optimizer_state)
    units = tuple(u.strip() for u in args.fsdp.split(",") if u.strip())
    return FSDP(units=units, world=args.world, optimizer_state=args.optimizer_state)


def _plan_report(source: str, result: Any) -> dict[str, Any]:
    return {
        "source": source, "nodes": result.graph.n, "solver": result.solver, "status": result.status,
        "budget_bytes": result.budget_bytes, "peak_bytes": result.predicted_peak_bytes,
        "unplanned_peak_bytes": result.baseline_peak_bytes, "overhead": result.predicted_overhead,
        "lower_bound_overhead": result.lower_bound, "solver_overhead": result.solver_overhead,
        "regions": len(result.regions), "selective_regions": sum(bool(r.saved) for r in result.regions),
        "solve_seconds": result.solve_seconds, "fingerprint": result.fingerprint,
    }


def _cache_command(args: argparse.Namespace) -> int:
    from optremat.planning.cache import PlanCache

    store = PlanCache(args.dir)
    if store.directory.exists() and not store.directory.is_dir():
        raise ValueError(f"--dir {args.dir} is a file, not a plan cache directory")
    if args.action == "clear":
        print(f"removed {store.clear()} plans from {store.directory}")
        return 0
    entries = store.entries()
    for e in entries:
        print(f"{e.key}  {e.status:12s} {e.solver:10s} budget {format_bytes(e.budget_bytes):>11s}  "
              f"overhead {e.predicted_overhead:7.2%}  time limit {e.time_limit:g} s  {format_bytes(e.bytes)}")
    print(f"{len(entries)} plans in {store.directory}")
    return 0


def _max_batch_command(args: argparse.Namespace) -> int:
    from optremat.core.budget import parse_size
    from optremat.planners.batch import LIMIT, max_batch
    from optremat.planning.batch import batch_ways

    memory = parse_size(args.memory)
    if math.isnan(args.max_overhead) or args.max_overhead < 0:
        raise ValueError(f"--max-overhead must be a fraction of extra compute >= 0 (0.25: 25%), "
                         f"not {args.max_overhead:g}")
    if args.head_chunks and not args.model.startswith("gpt"):
        raise ValueError(f"--head-chunks is for the built-in GPTs, not {args.model}")
    ways = batch_ways(args.model, args.head_chunks, args.device)

    def progress(label: str, batch: int, fits: bool) -> None:
        print(f"  {label:9s} batch {batch:6d}: {'fits' if fits else 'does not fit'}", file=sys.stderr, flush=True)

    result = max_batch(ways[0][1], memory, max_overhead=args.max_overhead, time_limit=args.time_limit,
                       deterministic=args.deterministic, progress=progress if args.progress else None,
                       alternatives=ways[1:])
    if result.planned == 0:
        print(f"optremat: infeasible: {_no_batch_fits(args, memory, ways)}", file=sys.stderr)
        return EXIT_INFEASIBLE
    report = {"model": args.model, "memory_bytes": memory, "max_overhead": args.max_overhead,
              "unplanned_batch": result.unplanned, "planned_batch": result.planned,
              "planned_overhead": result.planned_overhead, "planned_with": result.planned_with or None,
              "ratio": result.ratio if result.unplanned else None}
    if args.json:
        print(json.dumps(report))
        return 0
    way = f", LM head in {result.planned_with}" if result.planned_with else ""
    gain = f"{result.ratio:.2f}x" if result.unplanned else "not even batch 1 fits unplanned"
    capped = f" (the search stops at batch {LIMIT}: a larger one may fit)" if result.planned >= LIMIT else ""
    print(f"{args.model} in {format_bytes(memory)}: batch {result.unplanned} unplanned, {result.planned} planned "
          f"({gain}) at {result.planned_overhead:.1%} extra compute (cap {args.max_overhead:.0%}){way}{capped}")
    return 0


def _no_batch_fits(args: argparse.Namespace, memory: int,
                   ways: Sequence[tuple[str, Callable[[int], Graph]]]) -> str:
    """Why `memory` fits no batch of `args.model`: what batch 1 needs unplanned, and the
    least peak no plan of any way of running its step goes below."""
    graph = ways[0][1](1)
    floor = min(peak_floor(way(1)) for _, way in ways)
    return (f"{args.model} does not fit in {format_bytes(memory)} even at batch 1: its step needs "
            f"{format_bytes(simulate(graph, keep_all(graph)).peak_bytes)} unplanned, and no plan within "
            f"{args.max_overhead:.0%} extra compute fits (no plan goes below {format_bytes(floor)})")


def _bench_command(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from optremat.bench import PLANNERS, compare, compare_planners
    from optremat.models import load
    from optremat.tracing.extract import extract

    fractions = [float(f) for f in args.budgets.split(",")]
    torch_budgets = [float(b) for b in args.torch_budgets.split(",")] if args.torch_budgets else []
    if any(not 0 < f <= 1 for f in fractions) or any(not 0 <= b <= 1 for b in torch_budgets):
        raise ValueError("--budgets are fractions in (0, 1] and --torch-budgets in [0, 1]")
    if args.runs < 1 and not args.no_measure:
        raise ValueError(f"--runs must be at least 1 (or pass --no-measure), not {args.runs}")
    example = load(args.model)
    graph = extract(example.model, example.inputs, example.loss_fn)
    unplanned = simulate(graph, keep_all(graph)).peak_bytes

    def say(text: str) -> None:
        if not args.json:
            print(text, file=sys.stderr, flush=True)

    simulated = compare_planners(graph, fractions, time_limit=args.time_limit,
                                 report=lambda r: say(f"  {r.fraction:.0%} {r.planner}: {r.cell()}"))
    measured = [] if args.no_measure else compare(
        example.model, example.inputs, example.loss_fn, torch_budgets=torch_budgets, fractions=fractions,
        runs=args.runs, time_limit=args.time_limit,
        report=lambda r: say(f"  {r.method}{f' @ {r.matches}' if r.matches else ''}: "
                             + (r.note or f"peak {format_bytes(r.peak_bytes)}, overhead {r.overhead:+.1%}")))
    if args.plot:
        from optremat.plots import plot_lines

        lines = {p: [(100 * r.fraction, 100 * r.overhead) for r in simulated if r.planner == p and r.overhead is not None]
                 for p in PLANNERS}
        marks: dict[str, list[tuple[float, float]]] = {}
        for r in measured:
            if r.ran:
                label = "optremat (measured)" if r.matches else f"{r.method} (measured)"
                marks.setdefault(label, []).append((100 * r.peak_bytes / measured[0].peak_bytes, 100 * r.overhead))
        plot_lines(Path(args.plot), lines, f"{args.model}: overhead vs memory", "peak (% of unplanned)",
                   "extra compute (%)", invert_x=True, marks=marks)
    if args.json:
        print(json.dumps({"model": args.model, "unplanned_peak_bytes": unplanned,
                          "simulated": [asdict(r) for r in simulated], "measured": [asdict(r) for r in measured]}))
        return 0
    print(f"{args.model}: unplanned peak {format_bytes(unplanned)} (simulated); overhead per planner and budget "
          "(simulated on every op, planner seconds in brackets)")
    rows = [[f"{f:.0%}"] + [next(r.cell() for r in simulated if r.fraction == f and r.planner == p) for p in PLANNERS]
            for f in fractions]
    print(_columns(["budget", *PLANNERS], rows))
    if measured:
        print(f"\nmeasured ({args.runs} interleaved step pairs per method; overhead against the same mode's "
              "unplanned step)")
        print(_columns(["method", "vs", "peak", "of unplanned", "overhead", "predicted", "setup s"], [
            [r.method + (f" @ {r.matches}" if r.matches else ""), r.baseline]
            + ([r.note, "", "", "", ""] if not r.ran else [
                format_bytes(r.peak_bytes), f"{r.peak_bytes / measured[0].peak_bytes:.0%}", f"{r.overhead:+.1%}",
                "" if r.predicted_overhead is None else f"{r.predicted_overhead:+.1%}", f"{r.setup_seconds:.1f}"])
            for r in measured]))
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0


def _columns(header: list[str], rows: list[list[str]]) -> str:
    """A plain-text table with aligned columns."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in [header, *rows])


def _show_command(args: argparse.Namespace) -> int:
    from optremat.planning.result import Plan

    if args.top < 0:
        raise ValueError(f"--top must be a count of tensors >= 0, not {args.top}")
    result = Plan.load(args.plan)
    if args.plot:
        _plot(result, args.plot)
    if args.json:
        print(json.dumps(_plan_report(args.plan, result)))
        return 0
    print(result.summary())
    print()
    print(result.explain(top=args.top))
    if args.plot:
        print(f"memory plot written to {args.plot}")
    return 0


def _plot(result: Any, path: str) -> None:
    """Live bytes over the step, planned vs unplanned, recomputations marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graph = result.graph
    planned, unplanned = simulate(graph, result.schedule), simulate(graph, keep_all(graph))
    events = result.schedule.events
    recomputed = [k for k, (i, s, _) in enumerate(events) if s != i]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(unplanned.curve / 2**20, label="unplanned", color="0.6")
    ax.plot(planned.curve / 2**20, label="planned", color="C0")
    ax.scatter(recomputed, planned.curve[recomputed] / 2**20, s=6, color="C3", label="recomputation", zorder=3)
    ax.axhline(result.budget_bytes / 2**20, color="C1", linestyle="--", label="budget")
    ax.set_xlabel("op (execution order)")
    ax.set_ylabel("live MiB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


DEVICE_HELP = ("device profile ops are priced on: cpu, a100, h100, h200, or 'measured' (this machine's GPU, else its "
               "CPU, measured in about a second)")


def _device(text: str) -> Any:
    """A device profile's name, or for 'measured' this machine's profile measured now."""
    from optremat.tracing.costs import DEVICES
    if text == "measured":
        from optremat.tracing.calibrate import measure_profile
        return measure_profile()
    if text not in DEVICES:
        raise ValueError(f"unknown --device {text!r}; choose one of {', '.join(DEVICES)} or measured")
    return text


def _add_source(command: argparse.ArgumentParser, model_help: str) -> None:
    source = command.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help=model_help)
    source.add_argument("--graph", help="a graph file (optremat JSON or a published node-link benchmark graph)")
    command.add_argument("--device", default="cpu", help=DEVICE_HELP)


def _parser() -> argparse.ArgumentParser:
    from optremat.models import BUILDERS

    model_help = (f"a built-in model ({', '.join(sorted(BUILDERS))}) or path/to/file.py:function returning "
                  "(model, example_inputs[, loss_fn])")

    parser = argparse.ArgumentParser(prog="optremat", description="Activation rematerialization planning for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    graph = commands.add_parser("graph", help="extract (or load) a training-step graph and summarise it")
    _add_source(graph, model_help)
    graph.add_argument("--by-module", action="store_true", help="also group consecutive ops of one module")
    graph.add_argument("--save", help="write the extracted graph as JSON")
    graph.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    graph.set_defaults(run=_graph_command)
    plan = commands.add_parser("plan", help="plan rematerialization under a memory budget")
    _add_source(plan, model_help)
    plan.add_argument("--budget", required=True,
                      help="bytes (123456789), a size (6GiB, 500MB) or a fraction of the unplanned peak (0.5)")
    plan.add_argument("--solver", default="auto", choices=SOLVERS,
                      help="auto: the exact search over module regions; another also plans the coarsened "
                           "graph and seeds that search with its keep set (with --graph: the solver)")
    plan.add_argument("--time-limit", type=float, default=30.0, help="seconds for the exact solvers")
    plan.add_argument("--workers", type=int, default=0,
                      help="solver threads (0: all cores; eight for the search over module regions)")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--deterministic", action="store_true", help="reproducible solver runs")
    plan.add_argument("--progress", action="store_true", help="print each improving plan and bound to stderr")
    plan.add_argument("--save", help="write the plan (a model) or the schedule (a graph file) as JSON")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    plan.add_argument("--cache", help="plan cache directory (a model's plan is loaded from it when present)")
    plan.add_argument("--share", action="store_true",
                      help="with --graph, let pointwise ops write over an input they are the last to hold")
    plan.set_defaults(run=_plan_command)
    plan.add_argument("--fsdp", metavar="UNITS", help="plan one rank of FSDP2 with fully_shard on the modules "
                      "matching these comma-separated paths (`*` is one path component, as in 'blocks.*'), then the model")
    plan.add_argument("--ddp", action="store_true", help="plan one rank of DDP")
    plan.add_argument("--world", type=int, help="ranks of the --fsdp or --ddp job (the budget is per rank)")
    plan.add_argument("--optimizer-state", type=float, default=0.0,
                      help="optimizer state bytes per parameter byte held by each rank (2 for AdamW)")
    show = commands.add_parser("show", help="summarise a saved plan and explain its largest decisions")
    show.add_argument("plan", help="a plan written by `optremat plan --model ... --save`")
    show.add_argument("--plot", help="write memory over the step (planned vs unplanned) to this image")
    show.add_argument("--top", type=int, default=15, help="how many of the largest tensors to explain")
    show.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    show.set_defaults(run=_show_command)
    batch = commands.add_parser("max-batch", help="largest batch that fits a memory size, with and without planning")
    batch.add_argument("--model", required=True, choices=sorted(BUILDERS))
    batch.add_argument("--memory", required=True, help="bytes or a size such as 16GiB")
    batch.add_argument("--max-overhead", type=float, default=0.25, help="extra compute allowed for a planned batch")
    batch.add_argument("--time-limit", type=float, default=10.0, help="solver seconds per batch size tried")
    batch.add_argument("--deterministic", action="store_true", help="reproducible solver runs (deterministic time)")
    batch.add_argument("--device", default="cpu", help=DEVICE_HELP)
    batch.add_argument("--progress", action="store_true", help="print each batch size tried to stderr")
    batch.add_argument("--head-chunks", action="store_true",
                       help="a GPT's LM head and loss priced whole and in token chunks, the cheapest fitting taken")
    batch.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    batch.set_defaults(run=_max_batch_command)
    bench = commands.add_parser("bench", help="every planner at several budgets (simulated), and optremat against "
                                "per-block checkpointing and PyTorch's activation_memory_budget (measured)")
    bench.add_argument("--model", required=True, help=model_help)
    bench.add_argument("--budgets", default="0.7,0.5", help="fractions of the unplanned peak, comma-separated")
    bench.add_argument("--torch-budgets", default="0.5,0.1",
                       help="activation_memory_budget values for torch.compile, comma-separated ('' for none)")
    bench.add_argument("--runs", type=int, default=5, help="interleaved timing pairs per measured method")
    bench.add_argument("--time-limit", type=float, default=10.0, help="seconds per exact solve")
    bench.add_argument("--no-measure", action="store_true", help="simulated planner table only (no training steps)")
    bench.add_argument("--plot", help="write overhead vs memory (planners and measured methods) to this image")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    bench.set_defaults(run=_bench_command)
    cache = commands.add_parser("cache", help="list or clear the offline plan cache")
    cache.add_argument("action", choices=("list", "clear"))
    cache.add_argument("--dir", default=str(DEFAULT_CACHE), help=f"cache directory (default {DEFAULT_CACHE})")
    cache.set_defaults(run=_cache_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from optremat.tracing.extract import ExtractionError

    try:
        if hasattr(args, "device"):
            args.device = _device(args.device)
        return args.run(args)
    except InfeasibleBudget as error:
        print(f"optremat: infeasible: {error}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except TimeoutError as error:
        print(f"optremat: no plan: {error}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except (GraphError, ExtractionError, OSError, ValueError, KeyError) as error:
        print(f"optremat: error: {error.args[0] if isinstance(error, KeyError) else error}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
