"""The whole comparison suite in one command; writes benchmarks/RESULTS.md and its plots.

    python -m benchmarks.run --quick     # about 25 minutes on 2 CPU cores
    python -m benchmarks.run --full      # hours: larger models, every budget, longer solver limits
    python -m benchmarks.run --quick --graphs ../shared/graphs --sections peers,planners
    python -m benchmarks.run --full --sections planners,published,scaling --out exact.md   # own file and plots

Sections: `peers` (measured: no remat, per-block checkpointing, PyTorch's
activation_memory_budget, optremat at each peer's measured peak), `runtime` (measured:
both runtimes' peak and step time against the plan's), `planners` (every
planner on the built-in models at each budget, simulated; Pareto plots), `published`
(the Checkmate / Moccasin graphs), `vgg19` (Checkmate's max-batch result), `batch`
(largest batch at a fixed memory), `scaling` (solve time vs graph size), `layout` (arena
size vs live bytes: fragmentation of greedy and CP-SAT layouts). The headline
table at the top of RESULTS.md is drawn from them.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import layout, max_batch, peers, planners, runtime
from benchmarks.report import machine, table
from optremat.bench import PLANNERS
from optremat.plots import plot_lines

HERE = Path(__file__).parent
EXACT_COMMAND = "--full --sections planners,published,scaling --out exact.md"
SECTIONS = ("peers", "runtime", "planners", "published", "vgg19", "batch", "scaling", "layout")


@dataclass(frozen=True)
class Config:
    peer_models: tuple[str, ...]
    torch_budgets: tuple[float, ...]
    peer_fractions: tuple[float, ...]
    runs: int
    peer_limit: float
    runtime_models: tuple[str, ...]
    runtime_limit: float
    plan_models: tuple[str, ...]
    plan_fractions: tuple[float, ...]
    plan_limit: float
    published_limit: float
    batch_cases: tuple[tuple[str, str], ...]
    batch_limit: float
    scaling_layers: tuple[int, ...]
    scaling_limit: float


QUICK = Config(peer_models=("gpt-mini", "resnet-mini"), torch_budgets=(0.5, 0.1), peer_fractions=(0.5,), runs=5,
               peer_limit=10, runtime_models=tuple(runtime.DEFAULT_MODELS.split(",")), runtime_limit=20,
               plan_models=("gpt-small", "resnet", "unet", "vgg"), plan_fractions=(0.9, 0.7, 0.5, 0.3),
               plan_limit=15, published_limit=5, batch_cases=(("gpt-small", "16GiB"), ("resnet", "16GiB")),
               batch_limit=3, scaling_layers=(50, 125, 250), scaling_limit=5)
FULL = Config(peer_models=("gpt-mini", "resnet-mini", "gpt-small", "resnet"), torch_budgets=(0.7, 0.5, 0.3, 0.1, 0.0),
              peer_fractions=(0.7, 0.5, 0.3), runs=7, peer_limit=30,
              runtime_models=tuple(runtime.DEFAULT_MODELS.split(",")) + ("gpt-small", "resnet"), runtime_limit=30,
              plan_models=("gpt-small", "resnet", "unet", "vgg"),
              plan_fractions=planners.FRACTIONS, plan_limit=60, published_limit=60,
              batch_cases=(("gpt-small", "16GiB"), ("gpt-small+chunks", "16GiB"), ("resnet", "16GiB"),
                           ("unet", "16GiB"), ("vgg", "16GiB")),
              batch_limit=10, scaling_layers=(50, 125, 250, 500, 1000, 2500), scaling_limit=60)


def headline(config: Config, cells: dict, batches: dict, equal: str) -> str:
    """The three tables a reader needs first (nothing when the sections run hold none of them)."""
    parts = ["## Headline", ""]
    if equal:
        parts += ["### At equal measured peak (CPU, measured)", "",
                  "Each peer runs first; optremat then plans with the peer's measured peak as its budget. Overhead is "
                  "the median step-time ratio over interleaved pairs against the same mode's unplanned step (eager "
                  "for optremat and per-block checkpointing, `torch.compile` without a budget for PyTorch's planner).",
                  "", equal, ""]
    rows = []
    for name in config.plan_models:
        for fraction in (0.5, 0.3):
            row = cells.get((name, fraction))
            if row is not None:
                rows.append([name, f"{fraction:.0%}"] + [row[p] for p in PLANNERS])
    if rows:
        parts += ["### Overhead each planner needs at 50% and 30% of the unplanned peak (simulated)", "",
                  table(["model", "budget"] + list(PLANNERS), rows), ""]
    if batches:
        parts += ["### Largest batch at a fixed memory with at most 25% overhead (simulated)", "",
                  table(["model", "memory", "unplanned", "optremat", "ratio", "overhead"],
                        [[name, dict(config.batch_cases)[name], str(u), str(p), f"{p / u:.2f}x" if u else "-",
                          f"{o:.1%}"] for name, (u, p, o) in batches.items()]), ""]
    return "\n".join(parts) if len(parts) > 2 else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small configuration (the default)")
    size.add_argument("--full", action="store_true", help="every model, budget and longer solver limits")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--graphs", default=str(HERE.resolve().parents[1] / "shared" / "graphs"),
                        help="folder of the published graphs (sections published and vgg19)")
    parser.add_argument("--out", default="RESULTS.md",
                        help="file name under benchmarks/; its plots get the name as a suffix")
    args = parser.parse_args()
    config, mode = (FULL, "--full") if args.full else (QUICK, "--quick")
    sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    graphs = Path(args.graphs)
    suffix = "" if args.out == "RESULTS.md" else f"_{Path(args.out).stem}"
    started = time.perf_counter()
    body: list[str] = []
    cells: dict = {}
    batches: dict = {}
    equal = ""

    def section(title: str, *lines: str) -> None:
        body.extend([f"## {title}", "", *lines, ""])
        print(f"[{time.perf_counter() - started:5.0f} s] {title} done", flush=True)

    if "peers" in sections:
        print(peers.rockmate_status(), flush=True)
        measured: dict = {}
        every, equal = peers.models_section(list(config.peer_models), config.torch_budgets, config.peer_fractions,
                                            config.runs, config.peer_limit, measured)
        equal += "\n\n" + peers.losses_sentence(measured)
        caption = peers.memory_plot(config.peer_models[0], 0.7, config.peer_limit, HERE / "memory_over_time.png")
        section("Measured: optremat vs per-block checkpointing vs PyTorch's activation_memory_budget",
                f"Models {', '.join(config.peer_models)}; PyTorch budgets {config.torch_budgets} (backend "
                "`aot_eager_decomp_partition`: the min-cut partitioner inductor uses, without inductor's code "
                f"generation); {config.runs} interleaved timing pairs per method; optremat's solver limit "
                f"{config.peer_limit:g} s. Peaks are the CPU profiler's memory events, parameters and inputs included. "
                "`vs` names the baseline of the overhead.", "", peers.rockmate_status(), "", every, "", caption,
                "", "![memory over time](memory_over_time.png)")
    if "runtime" in sections:
        section("Plans executed: predicted vs measured peak and step time",
                f"Models {', '.join(config.runtime_models)}, at 30–90% of the unplanned peak; "
                f"solver limit {config.runtime_limit:g} s; {config.runs} interleaved timing pairs. "
                f"{runtime.DESCRIPTION}", "",
                runtime.section(list(config.runtime_models), [0.3, 0.5, 0.7, 0.9],
                                config.runtime_limit, config.runs))
    if "planners" in sections:
        text = planners.models_section(list(config.plan_models), config.plan_limit, config.plan_fractions, cells,
                                       suffix)
        section("Every planner on the built-in models (simulated)",
                f"Planned on the coarse graph, priced on every op; solver limit {config.plan_limit:g} s. Overhead = extra "
                "compute over the unplanned step, planner time in brackets; `infeasible (min X)` gives the smallest peak "
                "that planner reached as a fraction of the unplanned peak (parameters, gradients and inputs count).", "",
                text, "", " ".join(f"![{n}](overhead_{n}{suffix}.png)" for n in config.plan_models))
    if "published" in sections or "vgg19" in sections:
        if not graphs.is_dir():
            print(f"published graphs skipped: {graphs} does not exist", flush=True)
            section("Published graphs", f"Skipped: {graphs} does not exist (pass `--graphs DIR`).")
        else:
            if "published" in sections:
                section("Published graphs (Checkmate / Moccasin inputs), m = 0.9 / 0.8",
                        "Budget B = ceil(m × no-remat peak). Overhead of the best plan found, the solver's proven lower "
                        "bound on the overhead, and wall time.", "", planners.published_section(graphs, config.published_limit))
            if "vgg19" in sections:
                section("Checkmate's VGG19 max batch, reproduced on its graph",
                        max_batch.vgg19_section.__doc__.split("\n\n", 1)[1].strip().replace("\n    ", " "), "",
                        max_batch.vgg19_section(graphs, config.published_limit))
    if "batch" in sections:
        text = max_batch.models_section(list(config.batch_cases), 0.25, config.batch_limit, batches)
        section("Largest batch at a fixed memory (simulated, at most 25% overhead)",
                f"Solver limit {config.batch_limit:g} s per batch tried; graphs at any batch from traces at batch 1 and 2.",
                "", text)
    if "scaling" in sections:
        times: dict = {}
        text = planners.scaling_section(config.scaling_limit, config.scaling_layers, times)
        plot = f"solve_time{suffix}.png"
        plot_lines(HERE / plot, times, "solve time vs graph size (budget 50%)", "nodes", "seconds", log=True)
        section("Solve time vs graph size (random residual training graphs, budget 50%)", text, "",
                f"![solve time]({plot})", "",
                "The chain DP on training chains at 30% of the unplanned peak: overhead and time with its default "
                "block limit (longer chains are planned over merged blocks), with every layer a block where that "
                "is affordable (the DP's time grows with the cube of the blocks), and the best other heuristic.", "",
                planners.chain_section())
    if "layout" in sections:
        section("Memory layout, sharing and execution order (simulated)",
                "Every allocation of the schedule (storages and op workspaces, aligned to 64 bytes) gets an offset "
                "in one arena; tensors alive at once must not overlap. The live-bytes peak is the bound any layout "
                f"must meet; greedy by size is memonger's / TFLite's strategy; CP-SAT (no-overlap 2-D, limit "
                f"{config.plan_limit:g} s, hinted with greedy) is exact when it reports OPTIMAL. The last column is the "
                "same schedule's peak when every pointwise op that is the last reader of a same-sized input writes "
                "over it (compiled graphs do so under aot_eager through the op's out= overload).", "",
                layout.section(list(config.plan_models), 0.7, config.plan_limit), "",
                "Sharing as a decision of the solver, on every op of the small built-in models (the solvers plan "
                "realistic models on the coarsened graph, where the pointwise ops that could share are folded into "
                "their producers, so `plan()` shares in a pass over the expanded schedule instead). CP-SAT and the "
                "MILP choose, per op, whether to write over an input it is the last to hold; `least peak` is CP-SAT's "
                f"peak-minimising run (limit {config.plan_limit:g} s; the run with sharing is hinted with the plan "
                "without), then `auto`'s overhead at 90% of the unplanned peak.", "",
                layout.share_section(list(layout.SHARE_MODELS), 0.9, config.plan_limit), "",
                "Execution order: the traced order against the one `optremat.core.order.best_order` picks (greedy "
                "least-net-bytes list scheduling, in-place ops kept after the readers of what they overwrite; kept "
                "only where the unplanned peak drops). The budget is 70% of the traced order's unplanned peak. "
                "Compiled graphs run a reordered plan (`compile_backend(..., order=\"best\")`); the native runtime "
                "keeps the model's own order.", "",
                layout.order_section(list(config.plan_models), 0.7, config.plan_limit))
    command = " ".join([mode] + ([f"--sections {args.sections}"] if sections != list(SECTIONS) else [])
                       + ([f"--out {args.out}"] if args.out != "RESULTS.md" else []))
    intro = ["# optremat benchmark results", "",
             f"Regenerated by `python -m benchmarks.run {command}` in {time.perf_counter() - started:.0f} s on: {machine()}.",
             "Simulated figures are `simulate()` of the returned plans; measured figures say so."]
    if config is QUICK:
        intro.append(f"Solver limits are short here ({QUICK.plan_limit:g} s per plan on the built-in models, "
                     f"{QUICK.published_limit:g} s on the published graphs); the one-minute figures are in "
                     f"[exact.md](exact.md) (`python -m benchmarks.run {EXACT_COMMAND}`).")
    intro.append("")
    (HERE / args.out).write_text("\n".join(intro + [headline(config, cells, batches, equal)] + body) + "\n")
    print(f"wrote {HERE / args.out} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
