"""Plans executed: predicted vs measured peak and step-time overhead of the runtime.

    python -m benchmarks.runtime [--models gpt-tiny,resnet-tiny,...] [--budgets 0.3,0.5,0.7,0.9]
                                 [--limit 30] [--runs 5] [--cost-model roofline|profile] [--out runtime.md]

For each built-in model and budget (a fraction of the unplanned simulated peak)
it plans with `optremat.plan(..., solver="auto")`, applies the plan, and runs float32
training steps on the CPU: the measured peak (profiler memory events) against the plan's
predicted peak, and the step-time overhead as the median, over `runs` interleaved pairs,
of planned over unplanned step time. Where a budget is infeasible, one more row plans at
the smallest budget the planner reached. Writes benchmarks/<out>.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

import optremat
from optremat.bench import under
from optremat.core.graph import format_bytes
from optremat.models import build
from optremat.runtime.measure import measure_peak, step_resident

OUT = Path(__file__).with_name("runtime.md")
DEFAULT_MODELS = "gpt-tiny,resnet-tiny,unet-tiny,vgg-tiny,mlp-tiny,rnn-tiny"
HEADER = ["model", "budget", "plan", "predicted peak", "measured peak", "measured vs predicted",
          "measured / budget", "predicted overhead", "measured overhead (median)", "plan s"]
DESCRIPTION = ("Budgets are fractions of the unplanned simulated peak (parameters and gradients included); where one "
               "is infeasible, a last row plans at the smallest budget the planner reached. Plans price the "
               "model's loss (`loss_fn`). Measured peaks are profiler memory events (float32, CPU); overhead is the median over interleaved "
               "planned/unplanned step pairs.")


def section(models: list[str], budgets: list[float], limit: float, runs: int,
            written: Callable[[str], None] | None = None, cost_model: str = "roofline") -> str:
    """The table of every model and budget; `written`, when given, receives the
    table so far after each row, so a long run leaves its finished rows behind."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    print("  ".join(HEADER), flush=True)
    for name in models:
        for cells in rows(name, budgets, limit, runs, cost_model):
            print("  ".join(cells), flush=True)
            lines.append("| " + " | ".join(cells) + " |")
            if written is not None:
                written("\n".join(lines))
    return "\n".join(lines)


def rows(name: str, budgets: list[float], limit: float, runs: int, cost_model: str = "roofline"
         ) -> Iterator[list[str]]:
    """One row per budget; where a budget is infeasible, a last row at the smallest
    budget the planner reached, so every model shows a plan at its tightest."""
    example = build(name)
    model, inputs, loss_fn = example.model, example.inputs, example.loss_fn
    params = [p for p in model.parameters() if p.requires_grad]

    def step(module: torch.nn.Module) -> tuple:
        out = module(*inputs)
        return torch.autograd.grad(loss_fn(out), params)

    def row(budget: float | int) -> tuple[list[str], int | None]:
        """The row for `budget`, and the smallest budget reached when it is infeasible."""
        label = f"{budget:.0%}" if isinstance(budget, float) else f"smallest ({format_bytes(budget)})"
        started = time.perf_counter()
        try:
            plan = optremat.plan(model, inputs, budget, loss_fn=loss_fn, time_limit=limit, cost_model=cost_model)
        except optremat.InfeasibleBudget as error:
            return [name, label, f"infeasible (smallest {format_bytes(error.smallest)}, "
                    f"{error.smallest / _baseline(model, inputs, loss_fn):.0%})"] + ["-"] * 7, error.smallest
        except ValueError as error:
            return [name, label, f"refused: {str(error).split(';')[0]}"] + ["-"] * 7, None
        seconds = time.perf_counter() - started
        trained = optremat.apply(model, plan)
        step(trained)
        measured = measure_peak(lambda: step(trained), resident=step_resident(model, inputs, loss_fn)).peak_bytes
        optremat.remove(model)
        planned = under(model, plan, lambda: step(trained))
        ratios = []
        for _ in range(runs):
            times = []
            for run in (lambda: step(model), planned):
                begin = time.perf_counter()
                run()
                times.append(time.perf_counter() - begin)
            ratios.append(times[1] / times[0])
        return [name, label, f"{plan.solver} {plan.status}", format_bytes(plan.predicted_peak_bytes),
                format_bytes(measured), f"{measured / plan.predicted_peak_bytes - 1:+.1%}",
                f"{measured / plan.budget_bytes:.2f}", f"{plan.predicted_overhead:.1%}",
                f"{statistics.median(ratios) - 1:+.1%}", f"{seconds:.1f}"], None

    smallest = None
    for fraction in budgets:
        cells, least = row(fraction)
        smallest = least if least is not None else smallest
        yield cells
    if smallest is not None:
        yield row(smallest)[0]


def _baseline(model: torch.nn.Module, inputs: tuple, loss_fn) -> int:
    graph = optremat.extract(model, inputs, loss_fn)
    return optremat.simulate(graph, optremat.keep_all(graph)).peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--budgets", default="0.3,0.5,0.7,0.9")
    parser.add_argument("--limit", type=float, default=30.0, help="solver time limit per plan, seconds")
    parser.add_argument("--runs", type=int, default=5, help="interleaved timing pairs per plan")
    parser.add_argument("--cost-model", default="roofline", choices=("roofline", "profile"),
                        help="op costs the plans are priced with: the roofline model, or each op timed on this machine")
    parser.add_argument("--out", default="runtime.md", help="file name under benchmarks/")
    args = parser.parse_args()
    out = OUT.with_name(args.out)
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    intro = (f"# The runtime: predicted vs measured (CPU, float32; {args.models})\n\n"
             f"Machine: {machine}, no GPU. Command: `python -m benchmarks.runtime --models {args.models} "
             f"--budgets {args.budgets} --limit {args.limit:g} --runs {args.runs} --cost-model {args.cost_model} "
             f"--out {args.out}`. {DESCRIPTION}\n\n")
    section(args.models.split(","), [float(b) for b in args.budgets.split(",")],
            args.limit, args.runs, lambda text: out.write_text(intro + text + "\n"), args.cost_model)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
