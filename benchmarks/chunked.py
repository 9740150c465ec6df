"""A causal LM's head chunked by the plan: optremat's joint choice of LM head chunks and
checkpointed module calls against per-block checkpointing, with and without PyTorch's
own chunked `linear_cross_entropy`.

    python -m benchmarks.chunked [--model gpt-mini|gpt-small|nanogpt|llama|mixtral] [--rounds 9] [--limit 20]
                                 [--cost-model roofline|profile]

The model is gpt-mini's shape (`optremat.models.GPT`: vocabulary 8192, 256 tokens, width
256, 4 blocks, batch 4) returning its final hidden states; the loss is
`optremat.CausalLMLoss` over its tied head; every eager step holds the hidden states
through its backward (`out = model(idx)`), as a training loop does and plans price it.
Rows: the unplanned step with the whole head; per-block checkpointing (non-reentrant
`torch.utils.checkpoint` around every block) with the whole head, and with the head and
loss in `F.linear_cross_entropy` under PyTorch's default `LinearCrossEntropyOptions()`
(its own chunk size); the step (model and whole loss) under `torch.compile` with
PyTorch's `activation_memory_budget=0.3` (aot_eager_decomp_partition); optremat planned
with `chunks="auto"` at each of those measured peaks (where no plan is predicted to fit
one, at the least peak found, timed against that peer) and at 85%, 70% and 55% of
per-block checkpointing's; `optremat.compile_backend` (Inductor) on the model, the loss's
chunks left to it, at each peer's measured peak, its overhead measured against the model
compiled by Inductor unplanned with the whole head (the step its prediction is priced
against; that step's own row is against the eager one). The least peak of any region plan with the whole head and
with the chunks optremat prices is stated above the table (proven where the exact search
proved it). Step times as `benchmarks.native` measures them: every configuration in the
same process over `rounds` rounds after one uncounted warm-up round, in a shuffled order
each round, each right after an unplanned step; the overhead is the median of the
per-round ratios, and optremat / peer the median of the per-round ratios of optremat's
step to the step of the peer whose peak it was given. Predicted overheads come from the
roofline time model, which prices a pass over a chunk's logits (under 32 MiB) at the
CPU's cache rate and one over the whole logits at memory's, with their fresh pages
faulted in; the whole head's passes still run slower than that, so chunked plans measure
below their prediction.
With `--cost-model profile` (page `chunked_profile.md`) every op of every count's step is
timed on this machine instead (best of three, alone, so in cache).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import optremat
from benchmarks.native import EXPERTS, LLAMA, _time, compiled_plan
from benchmarks.report import write_rows
from optremat.bench import checkpointed_blocks, hf_checkpointing, torch_budget_backend, under
from optremat.compiler.backend import Backend
from optremat.core.graph import format_bytes
from optremat.models import HiddenGPT, LossGPT
from optremat.runtime.measure import measure_peak, resident_bytes
from optremat.tracing.costs import COST_MODELS

HEADER = ["method", "budget", "head", "module calls checkpointed", "predicted peak", "measured peak",
          "measured / predicted", "predicted overhead", "measured overhead (median)", "optremat / peer (median)",
          "plan s"]
SHAPE = dict(vocab=8192, seq=256, dim=256, layers=4, heads=4)
GPT_SMALL = dict(vocab=50257, seq=1024, dim=768, layers=12, heads=12)
BATCH = 4
TORCH_BUDGET = 0.3
"""PyTorch's `activation_memory_budget` compared with."""
LLAMA_PAGE = """The model is `benchmarks.native`'s CPU Llama (transformers' `LlamaForCausalLM` from its
config: vocabulary 8192, 256 tokens, width 256, 4 layers, batch 4, tied embeddings)
called as `model(input_ids=ids, labels=ids)`, its loss its own `outputs.loss`, its output
held through the backward as a training loop holds it (with the whole head, its logits).
Rows: the unplanned step; transformers' `gradient_checkpointing_enable()`
(non-reentrant); the step (model and its own loss) under `torch.compile` with PyTorch's
`activation_memory_budget=0.3` (aot_eager_decomp_partition); optremat planned with no
`loss_fn` (`head_chunks="auto"`: its own head and loss whole or in token chunks) at each
of those peaks and at 85%, 70% and 55% of the first; `compile_backend` (Inductor) on a
copy of the model compiled as it is (`torch.compile(model)`: the graph dynamo hands it
ends in the head and the model's own loss, which it takes out and runs after the graph
in the chunks the plan chooses, `optremat.compiler.own_loss`) at each peer's peak, its
overhead measured against a copy compiled by Inductor unplanned (whose own row is
against the eager step). The least peaks and step times as for gpt-mini
(`python -m benchmarks.chunked`)."""
"""The Llama page's description, after its command line."""
MIXTRAL_PAGE = """The model is the Llama's shape as transformers' `MixtralForCausalLM` (4 experts, 2
routed per token, transformers' own expert kernels, `output_router_logits=True`, so that
its loss adds the router's load-balancing loss, as a Mixtral is trained), called as
`model(input_ids=ids, labels=ids)`, its loss its own `outputs.loss`. optremat recognises
its forward by its code (Mixtral's form in `optremat.tracing.causal_lm.TEMPLATES`) and
runs its head and loss in the plan's chunks, the router's loss added as the forward adds
it. Rows as on the Llama's page (`python -m benchmarks.chunked --model llama`), but for
the compiled ones: `optremat.compile_causal_lm` with `compile_backend` (Inductor)
compiles its base model and runs its own head and loss after it in the chunks the plan
chooses (dynamo breaks a graph of the model as it is before its head, at the routing,
so there the head would run whole), against its base model compiled by Inductor."""
"""The Mixtral page's description, after its command line."""

Step = Callable[[], Any]


def torch_chunked(head: nn.Module, labels: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The shifted causal LM loss in `F.linear_cross_entropy` with PyTorch's default chunking."""
    shifted = F.pad(labels[..., 1:], (0, 1), value=-100).reshape(-1)

    def loss(hidden: torch.Tensor) -> torch.Tensor:
        return F.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight, shifted,
                                      options=nn.LinearCrossEntropyOptions())

    return loss


def gpt_mini(rounds: int, limit: float, cost_model: str) -> tuple[list[str], list[list[str]]]:
    """gpt-mini returning hidden states (`gpt`)."""
    return gpt(SHAPE, BATCH, rounds, limit, torch_budget=TORCH_BUDGET, cost_model=cost_model, inner="inductor")


def nanogpt(rounds: int, limit: float, cost_model: str) -> tuple[list[str], list[list[str]]]:
    """gpt-mini's shape taking its own loss in its forward (`LossGPT`), as nanoGPT does."""
    torch.manual_seed(0)
    model = LossGPT(**SHAPE)
    idx, targets = (torch.randint(0, SHAPE["vocab"], (BATCH, SHAPE["seq"])) for _ in range(2))
    params = list(model.parameters())

    def step_of(forward: Callable[..., tuple]) -> Step:
        def step() -> tuple:
            logits, loss = forward(idx, targets)  # both held through the backward, as nanoGPT's loop holds them
            return torch.autograd.grad(loss, params)
        return step

    step = step_of(model)

    def per_block() -> tuple:
        with checkpointed_blocks(model, [f"blocks.{i}" for i in range(SHAPE["layers"])]):
            return step()

    def compiled_step(backend: Backend | str) -> Step:
        return step_of(torch.compile(model, backend=backend, dynamic=False))

    forward = torch.compile(lambda: model(idx, targets)[1], backend=torch_budget_backend(TORCH_BUDGET))
    peers = {"per-block checkpoint": ("whole", per_block),
             f"PyTorch activation_memory_budget {TORCH_BUDGET:g} (torch.compile)": (
                 "whole", lambda: torch.autograd.grad(forward(), params))}
    pricing = {"cost_model": cost_model}
    return compare(model, (idx, targets), step, step, peers, dict(head_chunks=None, **pricing), pricing, rounds,
                   limit, compiled=lambda label, budget, measured: compiled_plan(
                       None, label, budget, "inductor", limit, pricing, compiled_step, measured),
                   compiled_unplanned=("inductor", compiled_step("inductor")))


def gpt(shape: dict[str, int], batch: int, rounds: int, limit: float, device: str = "cpu",
        dtype: torch.dtype = torch.float32, fractions: tuple[float, ...] = (0.85, 0.7, 0.55),
        least_peaks: bool = True, torch_budget: float | None = None, cost_model: str = "roofline",
        inner: str | None = None, profile: optremat.DeviceProfile | None = None) -> tuple[list[str], list[list[str]]]:
    """`HiddenGPT` of `shape` on `device` in `dtype`, its loss a `CausalLMLoss`, against
    per-block checkpointing with the whole head and with PyTorch's chunked loss, and with
    `torch_budget` against the step (model and whole loss) compiled under PyTorch's
    `activation_memory_budget`; optremat's ops priced by `cost_model` (on `profile`, the
    device's own by default); with `inner`, also
    `optremat.compile_backend` on the model (that inner compiler), the loss's chunks left
    to it, at each peer's peak."""
    torch.manual_seed(0)
    model = HiddenGPT(**shape).to(device, dtype)
    idx = torch.randint(0, shape["vocab"], (batch, shape["seq"]), device=device)
    labels = torch.randint(0, shape["vocab"], (batch, shape["seq"]), device=device)
    whole, auto = optremat.CausalLMLoss(model.head, labels, chunks=None), optremat.CausalLMLoss(model.head, labels)
    params = list(model.parameters())

    def step_of(loss_fn: Callable[[Any], torch.Tensor]) -> Step:
        def step() -> tuple:
            out = model(idx)  # held through the backward, as a training loop holds it and plans price it
            return torch.autograd.grad(loss_fn(out), params)
        return step

    def per_block(step: Step) -> Step:
        def run() -> tuple:
            with checkpointed_blocks(model, [f"blocks.{i}" for i in range(shape["layers"])]):
                return step()
        return run

    peers = {"per-block checkpoint": ("whole", per_block(step_of(whole)))}
    if hasattr(F, "linear_cross_entropy"):  # PyTorch 2.13 on
        peers["per-block checkpoint + F.linear_cross_entropy"] = (
            "LinearCrossEntropyOptions()", per_block(step_of(torch_chunked(model.head, labels))))
    if torch_budget is not None:
        forward = torch.compile(lambda ids: whole(model(ids)), backend=torch_budget_backend(torch_budget))
        peers[f"PyTorch activation_memory_budget {torch_budget:g} (torch.compile)"] = (
            "whole", lambda: torch.autograd.grad(forward(idx), params))
    def compiled_step(backend: Backend | str, loss_fn: Callable[[Any], torch.Tensor] = auto) -> Step:
        forward = torch.compile(model, backend=backend, dynamic=False)
        return lambda: torch.autograd.grad(loss_fn(forward(idx)), params)

    pricing = {"cost_model": cost_model} | ({} if profile is None else {"device": profile})
    compiled = None if inner is None else (lambda label, budget, measured: compiled_plan(
        auto, label, budget, inner, limit, pricing, compiled_step, measured))
    return compare(model, (idx,), step_of(whole), step_of(auto), peers, dict(loss_fn=whole, **pricing),
                   dict(loss_fn=auto, **pricing), rounds, limit, device, fractions, least_peaks, labels,
                   compiled, None if inner is None else (inner, compiled_step(inner, whole)))


def llama(rounds: int, limit: float, cost_model: str) -> tuple[list[str], list[list[str]]]:
    """The Llama with its own loss, against transformers' own gradient checkpointing; its
    compiled rows compile the model as it is."""
    return causal_lm("LlamaConfig", "LlamaForCausalLM", {}, rounds, limit, cost_model, as_it_is=True)


def mixtral(rounds: int, limit: float, cost_model: str) -> tuple[list[str], list[list[str]]]:
    """The Llama's shape as a Mixtral (`benchmarks.native.EXPERTS`) adding its router's loss;
    its compiled rows compile its base model (`compile_causal_lm`: dynamo breaks the graph
    before its head at the routing)."""
    return causal_lm("MixtralConfig", "MixtralForCausalLM", {**EXPERTS["mixtral"], "output_router_logits": True},
                     rounds, limit, cost_model, as_it_is=False)


def causal_lm(config_class: str, model_class: str, extra: dict[str, Any], rounds: int, limit: float,
              cost_model: str, as_it_is: bool) -> tuple[list[str], list[list[str]]]:
    """A transformers causal LM of the Llama's shape (`benchmarks.native.LLAMA`, with
    `extra` in its config) with its own loss, against transformers' own gradient
    checkpointing; compiled as it is (`as_it_is`: `torch.compile(model)`, its head and
    loss taken out of the graph, `compiler.own_loss`) or through `compile_causal_lm`."""
    import transformers

    torch.manual_seed(0)
    shape = dict(LLAMA["cpu"])
    batch, seq = shape.pop("batch"), shape.pop("seq")
    config = getattr(transformers, config_class)(vocab_size=8192, max_position_embeddings=seq,
                                                 attn_implementation="sdpa", tie_word_embeddings=True,
                                                 use_cache=False, **shape, **extra)
    model = getattr(transformers, model_class)(config).train()
    ids = torch.randint(0, 8192, (batch, seq))
    inputs = {"input_ids": ids, "labels": ids}
    params = list(model.parameters())

    def step() -> tuple:
        outputs = model(**inputs)  # held through the backward, as a training loop holds it
        return torch.autograd.grad(outputs.loss, params)

    def per_block() -> tuple:
        with hf_checkpointing(model):
            return step()

    whole = torch.compile(lambda: model(**inputs).loss, backend=torch_budget_backend(TORCH_BUDGET))

    def compiled_step(backend: Backend | str) -> Step:
        """The step of a copy of the model (its plan installed on it alone), compiled as
        it is or its base model under `compile_causal_lm` (by Inductor, unplanned)."""
        copied = copy.deepcopy(model)
        weights = list(copied.parameters())
        if as_it_is:
            run = torch.compile(copied, backend=backend, dynamic=False)
        elif isinstance(backend, str):  # its base model compiled, the head whole
            copied.model = torch.compile(copied.model, backend=backend, dynamic=False)
            run = copied
        else:
            run = optremat.compile_causal_lm(copied, backend)
        return lambda: torch.autograd.grad(run(**inputs).loss, weights)

    peers = {"gradient_checkpointing_enable()": ("whole", per_block),
             f"PyTorch activation_memory_budget {TORCH_BUDGET:g} (torch.compile)": (
                 "whole", lambda: torch.autograd.grad(whole(), params))}
    return compare(model, inputs, step, step, peers, dict(head_chunks=None, cost_model=cost_model),
                   dict(cost_model=cost_model), rounds, limit,
                   compiled=lambda label, budget, measured: compiled_plan(
                       None, label, budget, "inductor", limit, {"cost_model": cost_model}, compiled_step, measured,
                       "optremat compile_backend" if as_it_is else "optremat compile_causal_lm"),
                   compiled_unplanned=("inductor", compiled_step("inductor")))


def compare(model: nn.Module, inputs: Any, unplanned: Step, planned_step: Step, peers: dict[str, tuple[str, Step]],
            whole: dict[str, Any], auto: dict[str, Any], rounds: int, limit: float, device: str = "cpu",
            fractions: tuple[float, ...] = (0.85, 0.7, 0.55), least_peaks: bool = True, targets: Any = (),
            compiled: Callable[[str, int, Callable[[Step], int]], tuple[Step | None, dict[str, str]]] | None = None,
            compiled_unplanned: tuple[str, Step] | None = None) -> tuple[list[str], list[list[str]]]:
    """The least peaks of region plans with the whole head (`whole`: plan()'s options
    for it) and with its chunks priced (`auto`), and the rows: the `unplanned` step, each
    of `peers` (its head, its step), and optremat's plans (`planned_step` run with each
    installed) at each peer's measured peak (at the least peak found where none fits
    it, timed against that peer) and at `fractions` of the first one's,
    every peak measured on `device` (the least peaks left out without `least_peaks`), with
    the parameters, buffers, inputs and loss `targets` resident, as plans price them;
    with `compiled(label, budget, measured)`, a compiled plan's step and row at each
    peer's peak too, its overhead measured against `compiled_unplanned` (its inner
    compiler's name and its unplanned step, the head whole), as its prediction is priced."""
    params = list(model.parameters())
    resident = [params, list(model.buffers()), inputs, targets]

    def measured(run: Step) -> int:
        run()
        return measure_peak(run, resident=resident, device=device).peak_bytes

    methods: dict[str, tuple[Step | None, dict[str, str]]] = {
        "unplanned": (unplanned, {"method": "unplanned", "head": "whole",
                                  "measured peak": format_bytes(measured(unplanned))})}
    peaks = {}
    for name, (head, run) in peers.items():
        peaks[name] = measured(run)
        methods[name] = (run, {"method": name, "head": head, "measured peak": format_bytes(peaks[name])})
    if compiled_unplanned is not None:
        inner, run = compiled_unplanned
        methods["compiled"] = (run, {"method": f"unplanned, torch.compile ({inner})", "head": "whole",
                                     "measured peak": format_bytes(measured(run))})
    peer = next(iter(peers))
    peer_peak = peaks[peer]
    floors = []
    held = resident_bytes(resident) + sum(p.numel() * p.element_size() for p in params)  # and their gradients
    for name, options in (("whole head", whole), ("chunks priced", auto)) if least_peaks else ():
        try:  # the parameters, inputs and gradients every step holds: no plan fits in them alone
            optremat.plan(model, inputs, held, time_limit=limit, **options)
        except optremat.InfeasibleBudget as error:
            floors.append(f"least peak of any region plan, {name}: {format_bytes(error.smallest)}"
                          f"{' (proven)' if error.proven else ''}")

    def planned(label: str, budget: int) -> None:
        started = time.perf_counter()
        plan = optremat.plan(model, inputs, budget, time_limit=limit, **auto)
        seconds = time.perf_counter() - started
        run = under(model, plan, planned_step)
        peak = measured(run)
        chunks = plan.chunking.chunks
        methods[label] = (run, {
            "method": "optremat", "budget": f"{label} ({format_bytes(budget)})",
            "head": "whole" if chunks is None else f"{chunks} chunks",
            "module calls checkpointed": str(len(plan.regions)),
            "predicted peak": format_bytes(plan.predicted_peak_bytes), "measured peak": format_bytes(peak),
            "measured / predicted": f"{peak / plan.predicted_peak_bytes:.3f}",
            "predicted overhead": f"{plan.predicted_overhead:+.1%}", "plan s": f"{seconds:.1f}"})

    for label, budget in [(f"= {name}", peak) for name, peak in peaks.items()] + [
            (f"{f:.0%} of {peer}", int(peer_peak * f)) for f in fractions]:
        try:
            planned(label, budget)
        except optremat.InfeasibleBudget as error:
            methods[label] = (None, {"method": "optremat", "budget": label,
                                     "predicted peak": f"infeasible (smallest {format_bytes(error.smallest)})"})
            if label.startswith("= "):  # the least peak found, measured against the peer it could not match
                with contextlib.suppress(optremat.InfeasibleBudget):
                    planned(f"{label}, least peak found", error.smallest)
    for name, peak in peaks.items() if compiled is not None else ():
        label = f"= {name} ({format_bytes(peak)})"
        try:
            methods[f"compile_backend = {name}"] = compiled(label, peak, measured)
        except Exception as error:  # a row, not the page, lost: the other rows took minutes of a lent device
            methods[f"compile_backend = {name}"] = (None, {"method": "optremat compile_backend", "budget": label,
                                                             "predicted peak": f"failed: {type(error).__name__}"})
    _time(methods, rounds, device)
    return floors, [[fields.get(column, "-") for column in HEADER] for _, fields in methods.values()]


NANOGPT_PAGE = """The model is gpt-mini's shape (`optremat.models.LossGPT`: vocabulary 8192, 256
tokens, width 256, 4 blocks, batch 4) taking its own loss in its forward, as nanoGPT does
(`logits, loss = model(idx, targets)`, both held through the backward); it is planned
with no loss_fn, and where the plan runs the head in chunks its logits are deferred until
the forward's `F.cross_entropy` reads them (`optremat.tracing.deferred_head`). The rows of
gpt-mini's page (`python -m benchmarks.chunked`) but for the one needing the model
rewritten (`F.linear_cross_entropy`). `compile_backend` (Inductor) compiles the model
as it is: the graph dynamo hands it ends in the head and the loss, which it takes out,
planning the graph before them with them run after it in token chunks
(`optremat.compiler.own_loss`; the logits then come back None); its overhead is measured
against the model compiled by Inductor unplanned."""
"""The nanoGPT page's description, after its command line."""

GPT_SMALL_PAGE = """The model is gpt-small's shape (`optremat.models.GPT` with GPT-2 small's shape:
vocabulary 50257, 1024 tokens, width 768, 12 blocks, 12 heads, batch 4) returning its
final hidden states; the loss is `optremat.CausalLMLoss` over its tied head. The rows of
gpt-mini's page (`python -m benchmarks.chunked`), with optremat at per-block
checkpointing's measured peak and at 60% of it (35% of the unplanned peak). A step takes
about 45 s on this CPU, so the overheads come from the rounds the command line names: one
round is an indication only (the unplanned row's overhead, its step against itself, is
the noise)."""
"""The gpt-small page's description, after its command line."""


def gpt_small(rounds: int, limit: float, cost_model: str) -> tuple[list[str], list[list[str]]]:
    """gpt-small returning hidden states (`gpt`), planned down to 35% of its unplanned peak."""
    return gpt(GPT_SMALL, BATCH, rounds, limit, fractions=(0.6,), cost_model=cost_model)


MODELS = {"gpt-mini": (gpt_mini, "chunked.md", "", None),
          "gpt-small": (gpt_small, "chunked_gpt_small.md", ": gpt-small", GPT_SMALL_PAGE),
          "nanogpt": (nanogpt, "chunked_nanogpt.md", ": a loss taken in the model's forward", NANOGPT_PAGE),
          "llama": (llama, "chunked_llama.md", ": a transformers Llama's own loss", LLAMA_PAGE),
          "mixtral": (mixtral, "chunked_mixtral.md", ": a transformers Mixtral's own loss, its router's included",
                      MIXTRAL_PAGE)}
"""Each model's rows, page, title and description (None: this module's own)."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=tuple(MODELS), default="gpt-mini")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--limit", type=float, default=20.0)
    parser.add_argument("--cost-model", default="roofline", choices=COST_MODELS,
                        help="how plans price ops: the roofline model, or each op timed here (profile)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread, no GPU"
    command = " ".join(["python -m benchmarks.chunked"] + sys.argv[1:])
    rows, out, title, page = MODELS[args.model]
    floors, table = rows(args.rounds, args.limit, args.cost_model)
    if args.cost_model != "roofline":
        out = out.replace(".md", f"_{args.cost_model}.md")
    page = page or __doc__.split("\n\n", 2)[2].strip()
    head = [f"# LM head chunks chosen with the region plan{title}", "",
            f"Machine: {machine}, torch {torch.__version__}. Command: `{command}`.", "", page, "",
            *[f"- {line}" for line in floors], ""]
    write_rows(Path(__file__).with_name(out), head, HEADER, [table])


if __name__ == "__main__":
    main()
