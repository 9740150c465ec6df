"""optremat as torch.compile's partitioner, against PyTorch's own memory budget; writes the table
and a plot per inner compiler (compile_<inner>.png beside it).

    python -m benchmarks.compile [--models gpt-mini,resnet-mini,llama] [--inner aot_eager,inductor]
                                 [--rounds 9] [--limit 20] [--cost-model roofline|profile]
    python -m benchmarks.compile --knapsack    (the knapsack drop-in against PyTorch's dp solver)

For each model and inner compiler: the compiled step with PyTorch's default partition
(`activation_memory_budget` 1) is measured, then PyTorch's `activation_memory_budget` at
0.5, 0.3 and 0.1 with its default knapsack solver; `optremat.compile_backend` is given
each of those measured peaks in bytes ("= torch f") and 90/70/50% of the unplanned
compiled peak. Every configuration gets a fresh backend callable, so dynamo never reuses
another configuration's graph. Each optremat row checks loss and gradients against
eager (float32, allclose 1e-5). Step times are measured in one process over `rounds`
rounds after one uncounted warm-up round; in each round the configurations run in a
shuffled order, each right after a step of the unplanned compiled step (an optremat row
and the PyTorch row whose peak it was given run back to back, in a random order), and
the overhead is the median of the per-round ratios. "optremat / torch" is the median of
the per-round ratios of the optremat row's step time to its PyTorch row's, with the
number of rounds in which optremat's step was the faster.
optremat's planner prices PyTorch's own min-cut partitions of the same joint graph
(`activation_memory_budget` 0 to 1 by 0.1) as it runs them and lets them compete; "PyTorch's
cheapest within budget, priced" is the cheapest of those that fits the row's budget, with
its fraction and predicted overhead, to set beside optremat's predicted overhead. The
Llama is transformers' `LlamaConfig` model (random weights, sdpa attention, tied
embeddings, dataclass output) with its loss computed outside the model from the logits.
"""

from __future__ import annotations

import argparse
import platform
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import optremat
from benchmarks.native import _seconds, case_of, compiled_loss
from benchmarks.report import keep_compiled, table, write_rows
from optremat.bench import torch_budget_backend
from optremat.core.graph import format_bytes
from optremat.plots import plot_lines
from optremat.runtime.measure import measure_peak, step_resident
from optremat.tracing.costs import COST_MODELS

HEADER = ["model", "inner", "method", "budget", "predicted peak", "measured peak", "measured / budget",
          "grads = eager", "predicted overhead", "PyTorch's cheapest within budget, priced",
          "measured overhead (median)", "optremat / torch (median)", "plan s", "compile s"]
TORCH_BUDGETS = (0.5, 0.3, 0.1)
FRACTIONS = (0.9, 0.7, 0.5)


def rows(name: str, inner: str, rounds: int, limit: float, cost_model: str) -> list[list[str]]:
    case = case_of(name, "cpu")
    model, inputs, loss_fn = case.model, case.inputs, case.loss_fn
    params = [p for p in model.parameters() if p.requires_grad]
    resident = step_resident(model, inputs, loss_fn)
    eager_loss = loss_fn(model(*inputs))
    eager = [eager_loss.detach()] + [g.detach() for g in torch.autograd.grad(eager_loss, params)]

    def compiled_step(backend: Callable) -> tuple[Callable[[], Any], float, bool]:
        compiled = torch.compile(model, backend=backend, dynamic=False)

        def step() -> list[torch.Tensor]:
            loss = loss_fn(compiled(*inputs))
            return [loss.detach()] + list(torch.autograd.grad(loss, params))

        started = time.perf_counter()
        first = step()
        seconds = time.perf_counter() - started
        same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(first, eager))
        return step, seconds, same

    def measured(run: Callable[[], Any]) -> int:
        return measure_peak(run, resident=resident).peak_bytes

    peer = inner if inner == "inductor" else "aot_eager"
    methods: dict[str, tuple[Callable[[], Any] | None, dict[str, str]]] = {}
    peaks: dict[str, int] = {}
    for fraction in (1.0,) + TORCH_BUDGETS:
        run, seconds, same = compiled_step(torch_budget_backend(fraction, peer))
        key = "unplanned" if fraction == 1.0 else f"torch {fraction:g}"
        peaks[key] = measured(run)
        methods[key] = (run, {"method": f"torch, activation_memory_budget {fraction:g}",
                              "measured peak": format_bytes(peaks[key]), "grads = eager": "yes" if same else "NO",
                              "compile s": f"{seconds:.0f}"})
        print(name, inner, key, format_bytes(peaks[key]), flush=True)
    budgets = [(f"= {key}", peaks[key]) for key in peaks if key != "unplanned"]
    budgets += [(f"{f:.0%} of unplanned", int(f * peaks["unplanned"])) for f in FRACTIONS]
    priced = compiled_loss(case, name)
    for label, budget in budgets:
        backend = optremat.compile_backend(budget, inner=inner, time_limit=limit, loss_fn=priced, cost_model=cost_model)
        try:
            run, seconds, same = compiled_step(backend)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            if not isinstance(error.inner_exception, optremat.InfeasibleBudget):
                raise
            methods[label] = (None, {"method": "optremat", "budget": label,
                                     "predicted peak": f"infeasible (smallest {format_bytes(error.inner_exception.smallest)})"})
            continue
        plan = backend.plans[0]
        peak = measured(run)
        methods[label] = (run, {
            "method": "optremat" + (f" ({len(backend.plans)} graphs)" if len(backend.plans) > 1 else ""),
            "budget": f"{label}: {format_bytes(budget)}", "predicted peak": format_bytes(plan.predicted_peak_bytes),
            "measured peak": format_bytes(peak), "measured / budget": f"{peak / budget:.3f}",
            "grads = eager": "yes" if same else "NO", "predicted overhead": f"{plan.predicted_overhead:+.1%}",
            "PyTorch's cheapest within budget, priced": _cheapest_rival(backend.plans),
            "plan s": f"{sum(p.solve_seconds for p in backend.plans):.1f}", "compile s": f"{seconds:.0f}"})
        print(name, inner, label, format_bytes(peak), flush=True)
    _time(methods, rounds)
    return [[name, inner] + [fields.get(column, "-") for column in HEADER[2:]] for _, fields in methods.values()]


def _cheapest_rival(plans: list[optremat.Plan]) -> str:
    """The cheapest of PyTorch's partitions that competed for the first graph's plan and
    fit its budget, as optremat priced it ("-" when none fit)."""
    plan = plans[0]
    fitting = [(overhead, match[1]) for name, peak, overhead in plan.compared
               if peak <= plan.budget_bytes and (match := re.fullmatch(r"PyTorch min-cut at ([0-9.]+)", name))]
    if not fitting:
        return "-"
    overhead, fraction = min(fitting)
    return f"{fraction}: {overhead:+.1%}"


def _time(methods: dict[str, tuple[Callable[[], Any] | None, dict[str, str]]], rounds: int) -> None:
    """Median per-round overheads against the unplanned compiled step, and optremat's
    per-round ratio to the PyTorch configuration whose peak it was given. Each round runs
    its units in a shuffled order, each unit right after a step of the unplanned compiled
    step: a configuration alone, or an optremat row and its PyTorch peer back to back in a
    random order, so that the ratio compares steps run moments apart."""
    runs = {key: run for key, (run, _) in methods.items() if run is not None}
    paired = {key: key.removeprefix("= ") for key in runs if key.startswith("= ") and key.removeprefix("= ") in runs}
    units = [[key, peer] for key, peer in paired.items()]
    units += [[key] for key in runs if key not in paired and key not in paired.values()]
    order = random.Random(0)
    seconds: dict[str, list[float]] = {key: [] for key in runs}
    baseline: dict[str, list[float]] = {key: [] for key in runs}
    for round_ in range(rounds + 1):
        order.shuffle(units)
        for unit in units:
            base = _seconds(runs["unplanned"], "cpu")
            for key in order.sample(unit, len(unit)):
                mine = _seconds(runs[key], "cpu")
                if round_:
                    baseline[key].append(base)
                    seconds[key].append(mine)
    for key in runs:
        fields = methods[key][1]
        fields["measured overhead (median)"] = (
            f"{statistics.median(m / b for m, b in zip(seconds[key], baseline[key])) - 1:+.1%}")
        if key in paired:
            ratios = [m / p for m, p in zip(seconds[key], seconds[paired[key]])]
            fields["optremat / torch (median)"] = (f"{statistics.median(ratios):.3f} "
                                                   f"({sum(r < 1 for r in ratios)}/{len(ratios)} faster)")


KNAPSACK_HEADER = ["model", "activation_memory_budget", "items", "optremat saved", "optremat recompute",
                   "default (dp) saved", "default (dp) recompute"]


def knapsack_rows(name: str) -> list[list[str]]:
    """PyTorch's memory-budget partitioner on aot_eager with `optremat.KnapsackSolver`,
    and what its default dp solver answers to the same knapsacks: saved memory (as a
    fraction of the partitioner's activation range, the budget's unit) and the recompute
    left, in the configured estimator's runtimes (FLOPs)."""
    import torch._functorch.config as functorch_config
    from torch._functorch._activation_checkpointing.knapsack import dp_knapsack

    from optremat.compiler.knapsack import KnapsackSolver, runtime_estimate

    case = case_of(name, "cpu")
    found: list[list[str]] = []

    class Compared(KnapsackSolver):
        def __call__(self, memory, joint_graph, max_memory, node_info, nodes):  # noqa: ANN001 - PyTorch's hook
            saved, recomputed = super().__call__(memory, joint_graph, max_memory, node_info, nodes)
            runtimes = [runtime_estimate(n) for n in nodes]
            _, default_saved, default_recomputed = dp_knapsack(memory, runtimes, max_memory)
            found.append([name, f"{max_memory:g}", str(len(nodes)), f"{sum(memory[i] for i in saved):.5f}",
                          f"{sum(runtimes[i] for i in recomputed):.4g}",
                          f"{sum(memory[i] for i in default_saved):.5f}",
                          f"{sum(runtimes[i] for i in default_recomputed):.4g}"])
            return saved, recomputed

    for fraction in TORCH_BUDGETS:
        torch._dynamo.reset()
        with functorch_config.patch(activation_memory_budget=fraction, activation_memory_budget_solver=Compared()):
            compiled = torch.compile(case.model, backend="aot_eager", dynamic=False)
            case.loss_fn(compiled(*case.inputs)).backward()
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt-mini,resnet-mini,llama")
    parser.add_argument("--inner", default="aot_eager,inductor")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--limit", type=float, default=20.0)
    parser.add_argument("--cost-model", default="roofline", choices=COST_MODELS,
                        help="how optremat prices ops: the roofline, or each op timed on this machine")
    parser.add_argument("--out", default=str(Path(__file__).with_name("compile.md")))
    parser.add_argument("--knapsack", action="store_true",
                        help="compare the knapsack drop-in with PyTorch's default solver instead (prints a table)")
    args = parser.parse_args()
    if args.knapsack:
        print(table(KNAPSACK_HEADER, [row for name in args.models.split(",") for row in knapsack_rows(name)]))
        return
    torch.set_num_threads(2)
    keep_compiled()
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, no GPU"
    command = " ".join(["python -m benchmarks.compile"] + sys.argv[1:])
    head = ["# optremat as torch.compile's partitioner", "",
            f"Machine: {machine}, torch {torch.__version__}. Command: `{command}`.", "",
            __doc__.split("\n\n", 2)[2].strip(), ""]
    out, done = Path(args.out), []

    def batches() -> Iterator[list[list[str]]]:
        for inner in args.inner.split(","):
            for name in args.models.split(","):
                done.append(rows(name, inner, args.rounds, args.limit, args.cost_model))
                yield done[-1]

    write_rows(out, head, HEADER, batches())
    suffix = "" if args.cost_model == "roofline" else f"_{args.cost_model}"
    images = plot([row for batch in done for row in batch], out.parent, suffix)
    out.write_text(out.read_text() + "\n" + " ".join(f"![{name}]({name})" for name in images) + "\n")


def plot(table_rows: list[list[str]], directory: Path, suffix: str = "") -> list[str]:
    """compile_<inner><suffix>.png per inner compiler: each method's measured step
    overhead against its measured peak, optremat's and PyTorch's per model; returns the
    file names."""
    names = []
    for inner in dict.fromkeys(row[1] for row in table_rows):
        lines: dict[str, list[tuple[float, float]]] = {}
        for row in table_rows:
            cells = dict(zip(HEADER, row))
            if row[1] != inner or cells["measured peak"] == "-":
                continue
            method = "optremat" if cells["method"].startswith("optremat") else "PyTorch activation_memory_budget"
            lines.setdefault(f"{row[0]}, {method}", []).append(
                (float(cells["measured peak"].split()[0]), float(cells["measured overhead (median)"].rstrip("%"))))
        names.append(f"compile_{inner}{suffix}.png")
        plot_lines(directory / names[-1], lines, f"{inner}: measured step overhead vs measured peak",
                   "measured peak (MiB)", "measured overhead (%)")
    return names

if __name__ == "__main__":
    main()
