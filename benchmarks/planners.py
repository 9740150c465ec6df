"""Planners head to head: exact solvers vs heuristics on the built-in models and the
published benchmark graphs, and solver time vs graph size.

    python -m benchmarks.planners [--models gpt-small,resnet,unet,vgg] [--graphs ../shared/graphs]
                                  [--limit 60] [--sections models,published,scaling]

Prints each table as it goes and writes benchmarks/planners_<section>.md per section. Every overhead and peak
is simulate() of the returned schedule (built-in models: expanded to every op of the
fine graph); the budget is a fraction of the unplanned simulated peak.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import numpy as np

from benchmarks.report import machine, table
from optremat import Graph, InfeasibleBudget, extract, keep_all, resolve_budget, simulate, solve
from optremat.bench import PLANNERS, compare_planners
from optremat.core import published
from optremat.core.coarsen import coarsen
from optremat.core.synthetic import random_training_graph, training_chain
from optremat.heuristics import NotAChain
from optremat.heuristics.dp import MAX_BLOCKS, chain_dp
from optremat.ilp.cpsat import solve_cpsat
from optremat.ilp.milp import solve_milp
from optremat.models import build
from optremat.planners.solve import HEURISTICS, MAX_COPIES
from optremat.plots import plot_lines

HERE = Path(__file__).parent


FRACTIONS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)


def models_section(names: list[str], limit: float, fractions: tuple[float, ...] = FRACTIONS,
                   cells: dict[tuple[str, float], dict[str, str]] | None = None, plot_suffix: str = "") -> str:
    """The table of every planner at every budget; `cells`, when given, receives each
    row's cells by (model, fraction) for the headline table. Plots go to
    overhead_<model><plot_suffix>.png."""
    header = ["model", "ops / coarse", "budget"] + list(PLANNERS) + ["auto: status, gap"]
    rows = []
    for name in names:
        example = build(name)
        graph = extract(example.model, example.inputs, example.loss_fn)
        results = compare_planners(graph, fractions, time_limit=limit)
        curves: dict[str, list[tuple[float, float]]] = {planner: [] for planner in PLANNERS}
        for fraction in fractions:
            here = {r.planner: r for r in results if r.fraction == fraction}
            row = [name, f"{graph.n} / {coarsen(graph).coarse.n}", f"{fraction:.0%}"]
            row += [here[p].cell() for p in PLANNERS] + [here["auto"].detail or "-"]
            rows.append(row)
            for r in here.values():
                if r.overhead is not None:
                    curves[r.planner].append((fraction, r.overhead))
            if cells is not None:
                cells[name, fraction] = dict(zip(header, row))
            print(" | ".join(row), flush=True)
        _plot(name, curves, plot_suffix)
    return table(header, rows)


def _plot(name: str, curves: dict[str, list[tuple[float, float]]], suffix: str = "") -> None:
    """overhead_<model><suffix>.png: overhead vs budget, one line per planner."""
    lines = {planner: [(100 * f, 100 * v) for f, v in points] for planner, points in curves.items()}
    plot_lines(HERE / f"overhead_{name}{suffix}.png", lines, f"{name}: overhead vs budget (simulated)",
               "budget (% of unplanned peak)", "extra compute (%)", invert_x=True)


STRUCTURE_FREE = ("dtr", "split")
"""Heuristics that need no forward/backward flags (the random layered graphs have none)."""


def published_section(folder: Path, limit: float) -> str:
    """Every heuristic, CP-SAT (hinted with the best heuristic, with as many copies per
    node as the hint uses, up to MAX_COPIES, as `auto` does) and the MILP on each
    published graph at m = 0.9 and 0.8."""
    columns = [("cpsat", 10.0)] if limit > 10 else []
    columns += [("cpsat", limit), ("ilp", limit)]
    header = (["graph", "nodes", "m"] + list(HEURISTICS)
              + [f"{solver} {seconds:g} s (bound)" for solver, seconds in columns])
    rows = []
    for path in sorted(folder.glob("*.json")):
        graph = published.load(path)
        for m in (0.9, 0.8):
            budget = resolve_budget(graph, m)
            row = [path.stem, str(graph.n), f"{m}"]
            best = None
            for name in HEURISTICS:
                if not graph.backward.any() and name not in STRUCTURE_FREE:
                    row.append("n/a (no backward)")
                    continue
                try:
                    s = solve(graph, budget, solver=name)
                    best = s if best is None or s.cost < best.cost else best
                    row.append(f"{s.cost / graph.total_cost - 1:.2%}")
                except InfeasibleBudget:
                    row.append("none fits")
                except NotAChain:
                    row.append("n/a (no backward)")
            for solver, seconds in columns:
                if solver == "ilp" and graph.n > 80:
                    row.append("skipped (> 80 nodes)")
                    continue
                try:
                    if solver == "cpsat":
                        hint = None if best is None else best.schedule
                        copies = 2 if hint is None else max(2, min(int(np.bincount(hint.node).max()), MAX_COPIES))
                        s = solve_cpsat(graph, budget, time_limit=seconds, hint=hint, copies=copies)
                    else:
                        s = solve_milp(graph, budget, time_limit=seconds)
                    row.append(f"{s.cost / graph.total_cost - 1:.2%} (≥{s.lower_bound / graph.total_cost - 1:.2%}, "
                               f"{s.seconds:.1f} s)")
                except InfeasibleBudget as error:
                    row.append(f"infeasible (min {error.smallest / simulate(graph, keep_all(graph)).peak_bytes:.3f})")
                except TimeoutError:
                    row.append("no plan in time")
            rows.append(row)
            print(" | ".join(row), flush=True)
    return table(header, rows)


def scaling_section(limit: float, layer_counts: tuple[int, ...] = (50, 125, 250, 500, 1000, 2500),
                    times: dict[str, list[tuple[int, float]]] | None = None) -> str:
    """Solvers on random residual training graphs of growing size; `times`, when given,
    receives (nodes, seconds) per solver for the solve-time plot."""
    header = ["graph", "nodes", "cpsat: first plan", f"cpsat {limit:g} s", f"auto {limit:g} s (hinted)",
              "best heuristic", "slowest heuristic", f"ilp {limit:g} s"]
    rows = []
    times = {} if times is None else times
    for layers in layer_counts:
        graph = random_training_graph(layers)
        budget = resolve_budget(graph, 0.5)
        row = [f"random training, {layers} layers", str(graph.n)]
        firsts: list[float] = []
        try:
            s = solve_cpsat(graph, budget, time_limit=limit, progress=lambda t, c, b: firsts.append(t))
            row += [f"{firsts[0]:.1f} s" if firsts else "-", _overhead(graph, s)]
            times.setdefault("cpsat: first plan", []).append((graph.n, firsts[0] if firsts else s.seconds))
            times.setdefault("cpsat: best in limit", []).append((graph.n, s.seconds))
        except (InfeasibleBudget, TimeoutError) as error:
            row += ["none", _failure(error, limit)]
        try:
            row.append(_overhead(graph, solve(graph, budget, solver="auto", time_limit=limit)))
        except (InfeasibleBudget, TimeoutError) as error:
            row.append(_failure(error, limit))
        slowest, best = 0.0, None
        for name in HEURISTICS:
            start = time.perf_counter()
            try:
                s = solve(graph, budget, solver=name)
                best = s if best is None or s.cost < best.cost else best
            except (InfeasibleBudget, NotAChain):
                pass
            slowest = max(slowest, time.perf_counter() - start)
        row += ["none" if best is None else f"{best.cost / graph.total_cost - 1:.2%} ({best.solver})", f"{slowest:.2f} s"]
        times.setdefault("heuristics (slowest)", []).append((graph.n, slowest))
        if graph.n <= 250:
            try:
                s = solve_milp(graph, budget, time_limit=limit)
                row.append(_overhead(graph, s))
                times.setdefault("ilp", []).append((graph.n, s.seconds))
            except (InfeasibleBudget, TimeoutError) as error:
                row.append(_failure(error, limit))
        else:
            row.append("skipped (O(n²) variables)")
        rows.append(row)
        print(" | ".join(row), flush=True)
    return table(header, rows)


def chain_section(fraction: float = 0.3, layer_counts: tuple[int, ...] = (100, 1000)) -> str:
    """The chain DP on training chains of uniform and of random layers: its time and
    overhead with the default block limit, ungrouped where that is affordable, and the
    best other heuristic's."""
    header = ["chain", "nodes", f"dp ({MAX_BLOCKS} blocks)", "dp (every layer a block)", "best other heuristic"]
    rows = []
    for layers in layer_counts:
        rng = random.Random(layers)
        chains = {"uniform": training_chain([1.0] * layers, [1 << 20] * layers),
                  "random": training_chain([rng.uniform(1, 10) for _ in range(layers)],
                                           [rng.randint(1, 16) << 16 for _ in range(layers)])}
        for kind, graph in chains.items():
            budget = resolve_budget(graph, fraction)
            row = [f"{kind}, {layers} layers", str(graph.n)]
            for blocks in (MAX_BLOCKS, layers if layers <= 200 else None):
                if blocks is None:
                    row.append("skipped (cubic in blocks)")
                    continue
                start = time.perf_counter()
                result = simulate(graph, chain_dp(graph, budget, max_blocks=blocks))
                row.append(f"{result.overhead:.2%}, {time.perf_counter() - start:.2f} s")
            others = []
            for name in HEURISTICS:
                if name == "dp":
                    continue
                try:
                    others.append((solve(graph, budget, solver=name).cost, name))
                except InfeasibleBudget:
                    continue
            cost, name = min(others, default=(None, "none fits"))
            row.append(name if cost is None else f"{cost / graph.total_cost - 1:.2%} ({name})")
            rows.append(row)
            print(" | ".join(row), flush=True)
    return table(header, rows)


def _overhead(graph: Graph, solution) -> str:
    bound = "" if solution.lower_bound is None else f" (≥{solution.lower_bound / graph.total_cost - 1:.2%})"
    return f"{solution.cost / graph.total_cost - 1:.2%}{bound}, {solution.seconds:.1f} s"


def _failure(error: Exception, limit: float) -> str:
    return "infeasible" if isinstance(error, InfeasibleBudget) else f"no plan in {limit:g} s"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt-small,resnet,unet,vgg")
    parser.add_argument("--graphs", default=str(Path(__file__).resolve().parents[2] / "shared" / "graphs"))
    parser.add_argument("--limit", type=float, default=60.0, help="seconds per exact solve")
    parser.add_argument("--sections", default="models,published,scaling")
    args = parser.parse_args()
    sections = args.sections.split(",")
    written = {}
    if "models" in sections:
        written["models"] = ["## Built-in models (planned on the coarse graph, priced on every op)", "",
                  "Overhead = extra compute over the unplanned step (simulated), planner time in brackets; "
                  "`infeasible (min X)` gives the smallest peak that planner reached (for auto: the least "
                  "the peak-minimising CP-SAT model found) as a fraction of the unplanned peak. Plots: "
                  "`overhead_<model>.png`.", "", models_section(args.models.split(","), args.limit), ""]
    if "published" in sections:
        folder = Path(args.graphs)
        if folder.is_dir():
            written["published"] = ["## Published graphs (Checkmate / Moccasin inputs)", "",
                      "Budget B = ceil(m × no-remat peak). Overhead of the best plan found, "
                      "the solver's proven lower bound on the overhead, and wall time.", "",
                      published_section(folder, args.limit), ""]
        else:
            print(f"published graphs skipped: {folder} does not exist")
    if "scaling" in sections:
        written["scaling"] = ["## Solve time vs graph size (budget 50%)", "", scaling_section(args.limit), ""]
    for section, parts in written.items():
        path = HERE / f"planners_{section}.md"
        path.write_text("\n".join(parts[:1] + ["", f"Machine: {machine()}. Command: `python -m benchmarks.planners "
                                                  f"--limit {args.limit:g} --sections {section}`."] + parts[1:]))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
