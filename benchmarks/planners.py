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
import os
import platform
import random
import time
from pathlib import Path

import ortools
import torch

from optremat import Graph, InfeasibleBudget, extract, keep_all, resolve_budget, simulate, solve
from optremat.coarsen import coarsen
from optremat.heuristics import NotAChain
from optremat.ilp.cpsat import solve_cpsat
from optremat.ilp.milp import solve_milp
from optremat.models import build
from optremat.solve import HEURISTICS

HERE = Path(__file__).parent


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


FRACTIONS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
MODEL_PLANNERS = tuple(HEURISTICS) + ("lp-rounding", "auto")


def models_section(names: list[str], limit: float) -> str:
    header = ["model", "ops / coarse", "budget"] + list(MODEL_PLANNERS) + ["auto: status, gap"]
    rows = []
    for name in names:
        example = build(name)
        coarsened = coarsen(extract(example.model, example.inputs, example.loss_fn))
        fine, coarse = coarsened.fine, coarsened.coarse
        unplanned = simulate(fine, keep_all(fine)).peak_bytes
        curves: dict[str, list[tuple[float, float]]] = {planner: [] for planner in MODEL_PLANNERS}
        for fraction in FRACTIONS:
            budget = resolve_budget(fine, fraction)
            row = [name, f"{fine.n} / {coarse.n}", f"{fraction:.0%}"]
            detail = "-"
            for planner in MODEL_PLANNERS:
                if planner == "lp-rounding" and coarse.n > 150:
                    row.append("skipped (LP of O(n²) variables)")
                    continue
                try:
                    solution = solve(coarse, budget, solver=planner, time_limit=limit)
                except NotAChain:
                    row.append("n/a (not a chain)")
                    continue
                except InfeasibleBudget as error:
                    row.append(f"infeasible (min {error.smallest / unplanned:.0%})")
                    continue
                except TimeoutError:
                    row.append("no plan in time")
                    continue
                result = simulate(fine, coarsened.expand(solution.schedule))
                assert result.peak_bytes <= budget, (name, planner, result.peak_bytes, budget)
                row.append(f"{result.overhead:.1%} ({solution.seconds:.1f} s)")
                curves[planner].append((fraction, result.overhead))
                if planner == "auto":
                    gap = "" if solution.gap is None else f", gap {solution.gap:.2%}"
                    detail = f"{solution.solver} {solution.status}{gap}"
            rows.append(row + [detail])
            print(" | ".join(rows[-1]), flush=True)
        _plot(name, curves)
    return table(header, rows)


def _plot(name: str, curves: dict[str, list[tuple[float, float]]]) -> None:
    """overhead_<model>.png: overhead vs budget, one line per planner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for planner, points in curves.items():
        if points:
            x, y = zip(*points)
            axes.plot([100 * f for f in x], [100 * v for v in y], marker="o", label=planner)
    axes.set_xlabel("budget (% of unplanned peak)")
    axes.set_ylabel("extra compute (%)")
    axes.set_title(f"{name}: overhead vs budget (simulated)")
    axes.invert_xaxis()
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(HERE / f"overhead_{name}.png", dpi=110)
    plt.close(figure)


def published_section(folder: Path, limit: float) -> str:
    header = ["graph", "nodes", "m", "best heuristic", "cpsat 10 s (bound)", f"cpsat {limit:g} s (bound)",
              f"ilp {limit:g} s (bound)"]
    rows = []
    for path in sorted(folder.glob("*.json")):
        graph = Graph.load(path)
        for m in (0.9, 0.8):
            budget = resolve_budget(graph, m)
            row = [path.stem, str(graph.n), f"{m}"]
            best = None
            for name in HEURISTICS if graph.backward.any() else ():
                try:
                    s = solve(graph, budget, solver=name)
                    best = s if best is None or s.cost < best.cost else best
                except (InfeasibleBudget, NotAChain):
                    continue
            row.append("n/a (no backward)" if not graph.backward.any() else "none fits" if best is None else f"{best.cost / graph.total_cost - 1:.2%} ({best.solver})")
            for solver, seconds in (("cpsat", 10.0), ("cpsat", limit), ("ilp", limit)):
                if solver == "ilp" and graph.n > 80:
                    row.append("skipped (> 80 nodes)")
                    continue
                try:
                    if solver == "cpsat":
                        s = solve_cpsat(graph, budget, time_limit=seconds, hint=None if best is None else best.schedule)
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


def random_training_graph(layers: int, seed: int = 0) -> Graph:
    """A residual training graph: `layers` forward ops (some with skip inputs), a loss,
    and a backward op per layer reading the layer's input and the incoming gradient."""
    rng = random.Random(seed)
    edges, cost, size = [], [], []
    for i in range(layers):
        cost.append(rng.uniform(1, 10))
        size.append(rng.randint(1, 16) * 1024)
        if i:
            edges.append((i - 1, i))
        if i > 4 and rng.random() < 0.2:
            edges.append((i - rng.randint(2, 4), i))
    loss = layers
    cost.append(1.0)
    size.append(8)
    edges.append((layers - 1, loss))
    for k, i in enumerate(range(layers - 1, -1, -1)):
        b = loss + 1 + k
        cost.append(2 * cost[i])
        size.append(size[i])
        edges += [(b - 1, b)] + ([(i - 1, b)] if i else [])
    n = 2 * layers + 1
    return Graph.build(cost=cost, size=size, edges=sorted(set(edges)), backward=[False] * (layers + 1) + [True] * layers,
                       output=[False] * (n - 1) + [True])


def scaling_section(limit: float) -> str:
    header = ["graph", "nodes", "cpsat: first plan", f"cpsat {limit:g} s", f"auto {limit:g} s (hinted)",
              "best heuristic", "slowest heuristic", f"ilp {limit:g} s"]
    rows = []
    for layers in (50, 125, 250, 500, 1000, 2500):
        graph = random_training_graph(layers)
        budget = resolve_budget(graph, 0.5)
        row = [f"random training, {layers} layers", str(graph.n)]
        firsts: list[float] = []
        try:
            s = solve_cpsat(graph, budget, time_limit=limit, progress=lambda t, c, b: firsts.append(t))
            row += [f"{firsts[0]:.1f} s" if firsts else "-", _overhead(graph, s)]
        except (InfeasibleBudget, TimeoutError) as error:
            row += ["none", type(error).__name__]
        try:
            row.append(_overhead(graph, solve(graph, budget, solver="auto", time_limit=limit)))
        except (InfeasibleBudget, TimeoutError) as error:
            row.append(type(error).__name__)
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
        if graph.n <= 250:
            try:
                row.append(_overhead(graph, solve_milp(graph, budget, time_limit=limit)))
            except (InfeasibleBudget, TimeoutError) as error:
                row.append(type(error).__name__)
        else:
            row.append("skipped (O(n²) variables)")
        rows.append(row)
        print(" | ".join(row), flush=True)
    return table(header, rows)


def _overhead(graph: Graph, solution) -> str:
    bound = "" if solution.lower_bound is None else f" (≥{solution.lower_bound / graph.total_cost - 1:.2%})"
    return f"{solution.cost / graph.total_cost - 1:.2%}{bound}, {solution.seconds:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt-small,resnet,unet,vgg")
    parser.add_argument("--graphs", default=str(Path(__file__).resolve().parents[2] / "shared" / "graphs"))
    parser.add_argument("--limit", type=float, default=60.0, help="seconds per exact solve")
    parser.add_argument("--sections", default="models,published,scaling")
    args = parser.parse_args()
    sections = args.sections.split(",")
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
               f"ortools {ortools.__version__}, Python {platform.python_version()}")
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
        path.write_text("\n".join(parts[:1] + ["", f"Machine: {machine}. Command: `python -m benchmarks.planners "
                                                  f"--limit {args.limit:g} --sections {section}`."] + parts[1:]))
        print(f"wrote {path}")
    write_results()


def write_results() -> None:
    """RESULTS.md: every section file the suite has written, in a fixed order."""
    parts = ["# optremat benchmark results", "",
             "Each section below is regenerated by the command it names; numbers are simulate() of the "
             "returned plans unless a section says measured.", ""]
    for name in ("planners_models.md", "planners_published.md", "planners_scaling.md", "fidelity.md", "runtime.md",
                 "runtime_resnet.md", "runtime_large.md", "max_batch.md"):
        path = HERE / name
        if path.exists():
            text = path.read_text().strip().splitlines()
            parts += ["#" + text[0]] + text[1:] + [""]
    (HERE / "RESULTS.md").write_text("\n".join(parts))


if __name__ == "__main__":
    main()
