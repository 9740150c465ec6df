"""Equal measured peak: optremat's native runtime against what users pick instead.

    python -m benchmarks.native [--models gpt-mini,resnet-mini,llama,hf-resnet] [--rounds 9] [--limit 20]
                                [--cost-model roofline|profile] [--device cuda --backend inductor]

For each model: the unplanned step, per-block checkpointing (HF's
`gradient_checkpointing_enable()` for the Llama, non-reentrant `torch.utils.checkpoint`
around every repeated block for the built-in models) and `torch.compile` with PyTorch's
`activation_memory_budget` at 0.5 and 0.3 (backend aot_eager_decomp_partition unless
`--backend` names another, a fresh backend callable per budget) are measured; optremat is
planned with each peer's measured peak as its budget ("= peer"), and at 50/70/90% of the
unplanned simulated peak; at each PyTorch budget's peak, `optremat.compile_backend` (inner
aot_eager, or Inductor where the peers run Inductor) is compiled too ("compile_backend =
torch f"), what a user of `torch.compile` picks instead of PyTorch's budget, with the same
cost model as the native plans. Every
configuration's step time is measured in the same process over `rounds` rounds after one
uncounted warm-up round; in each round the configurations run in a shuffled order, each
right after a step of its baseline, and the overhead is the median of the per-round ratios
to that baseline, the unplanned step of the same mode: eager for optremat and per-block
checkpointing, the compiled step at budget 1 for PyTorch's budgets and compile_backend.
"optremat / peer" is the median of the per-round ratios of an optremat row's step time to
that of the peer whose peak it was given. The Llama (transformers' `LlamaConfig`, random
weights, sdpa attention, dataclass output, no KV cache in training; on a GPU a larger
configuration in bfloat16) computes its loss outside the model, from the logits, as users
do; optremat is planned with that loss given (`loss_fn`) and, at per-block checkpointing's
peak and at 70% and 90%, without it. hf-resnet is transformers' ResNet-18 (`ResNetConfig`,
random weights, batch norms, dataclass output) on 32 images of 96x96, its loss computed
outside the model too; per-block checkpointing wraps each residual block (the model has no
switch for it). mixtral and qwen-moe are mixtures of experts of the Llama's shape
(`MixtralConfig`, `Qwen2MoeConfig`: 4 experts, 2 per token, transformers' own grouped
expert kernels), measured as the Llama is.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F

import optremat
from benchmarks.report import keep_compiled, write_rows
from optremat.bench import checkpointed_blocks, hf_checkpointing, repeated_blocks, torch_budget_backend, under
from optremat.compiler.backend import Backend
from optremat.core.graph import format_bytes
from optremat.models import build
from optremat.runtime.measure import measure_peak, step_resident
from optremat.tracing.costs import COST_MODELS
from optremat.tracing.lm_loss import install

HEADER = ["model", "method", "budget", "predicted peak", "measured peak", "measured / predicted",
          "predicted overhead", "measured overhead (median)", "optremat / peer (median)", "plan s"]


@dataclass
class Case:
    """A model, its inputs, a loss over its output, and per-block checkpointing as users write it."""

    model: torch.nn.Module
    inputs: tuple
    loss_fn: Callable[[Any], torch.Tensor]
    per_block: Callable[[Callable[[], Any]], Any]


LLAMA = {"cpu": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, batch=4, seq=256),
         "cuda": dict(hidden_size=1024, intermediate_size=2752, num_hidden_layers=8, num_attention_heads=16,
                      num_key_value_heads=4, batch=8, seq=1024, dtype=torch.bfloat16)}
"""The Llama's shape on each kind of device (on a GPU in bfloat16, as it is trained there)."""
EXPERTS = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
           "qwen-moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=344,
                            shared_expert_intermediate_size=688, tie_word_embeddings=False)}
"""The mixtures of experts: the Llama's shape with 4 experts, 2 per token (Qwen2-MoE's
experts half as wide, beside its shared expert), from transformers' own expert kernels."""
THIRD_PARTY = ("llama", "hf-resnet", *EXPERTS)
"""The models from transformers: their output is a dataclass holding the logits."""


def llama(device: str, kind: str = "llama") -> Case:
    """The Llama, or with `kind` a mixture of experts of its shape (`EXPERTS`)."""
    import transformers

    torch.manual_seed(0)
    shape = dict(LLAMA["cuda" if device.startswith("cuda") else "cpu"])
    batch, seq, dtype = shape.pop("batch"), shape.pop("seq"), shape.pop("dtype", torch.float32)
    config_class, model_class = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                                 "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
                                 "qwen-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM")}[kind]
    config = getattr(transformers, config_class)(**{
        "vocab_size": 8192, "max_position_embeddings": seq, "attn_implementation": "sdpa",
        "tie_word_embeddings": True, "use_cache": False, **shape, **EXPERTS.get(kind, {})})
    model = getattr(transformers, model_class)(config).train().to(device, dtype)
    ids = torch.randint(0, 8192, (batch, seq)).to(device)
    labels = torch.randint(0, 8192, (batch * seq,)).to(device)

    def loss_fn(out: Any) -> torch.Tensor:
        return F.cross_entropy(out.logits.float().view(-1, 8192), labels)

    def per_block(step: Callable[[], Any]) -> Any:
        with hf_checkpointing(model):
            return step()

    return Case(model, (ids,), loss_fn, per_block)


def hf_resnet(device: str) -> Case:
    """transformers' ResNet-18 (`ResNetConfig`, basic blocks, batch norms, random weights,
    dataclass output) on 32 images of 96x96, its loss computed outside the model; per-block
    checkpointing wraps every residual block, since the model has no switch for it."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512], layer_type="basic",
                          num_labels=100)
    model = ResNetForImageClassification(config).train().to(device)
    images = torch.randn(32, 3, 96, 96, device=device)
    labels = torch.randint(0, 100, (32,), device=device)
    blocks = [name for name, module in model.named_modules() if type(module).__name__ == "ResNetBasicLayer"]

    def per_block(step: Callable[[], Any]) -> Any:
        with checkpointed_blocks(model, blocks):
            return step()

    return Case(model, (images,), lambda out: F.cross_entropy(out.logits, labels), per_block)


def built_in(name: str, device: str) -> Case:
    example = build(name, device=device)
    blocks = repeated_blocks(example.model)

    def per_block(step: Callable[[], Any]) -> Any:
        with checkpointed_blocks(example.model, blocks):
            return step()

    return Case(example.model, example.inputs, example.loss_fn, per_block)


def compiled_loss(case: Case, name: str) -> Callable[[Any], torch.Tensor]:
    """`case`'s loss as a compile backend's `loss_fn` takes it: on the outputs that get a
    gradient, which for the Llama is its logits tensor, not its dataclass output."""
    return (lambda logits: case.loss_fn(SimpleNamespace(logits=logits))) if name in THIRD_PARTY else case.loss_fn


def case_of(name: str, device: str) -> Case:
    """The Llama, a mixture of experts, the transformers ResNet or a built-in model by name."""
    if name in EXPERTS:
        return llama(device, name)
    return {"llama": llama, "hf-resnet": hf_resnet}.get(name, lambda d: built_in(name, d))(device)


def rows(name: str, rounds: int, limit: float, device: str, backend: str, cost_model: str = "roofline"
         ) -> list[list[str]]:
    case = case_of(name, device)
    model, inputs, loss_fn = case.model, case.inputs, case.loss_fn
    params = [p for p in model.parameters() if p.requires_grad]
    resident = step_resident(model, inputs, loss_fn)

    def step_of(module: torch.nn.Module) -> Callable[[], tuple]:
        def step() -> tuple:
            out = module(*inputs)
            return torch.autograd.grad(loss_fn(out), params)

        return step

    step = step_of(model)

    def measured(run: Callable[[], Any]) -> int:
        run()
        return measure_peak(run, resident=resident, device=device).peak_bytes

    methods: dict[str, tuple[Callable[[], Any] | None, dict[str, str]]] = {}
    unplanned = measured(step)
    methods["unplanned"] = (step, {"method": "unplanned", "measured peak": format_bytes(unplanned)})
    blocks = lambda: case.per_block(step)  # noqa: E731
    block_peak = measured(blocks)
    methods["per-block"] = (blocks, {"method": "per-block checkpoint", "measured peak": format_bytes(block_peak)})
    budgets: list[tuple[str, int | float, bool]] = [("= per-block", block_peak, True)]
    if name == "llama":
        budgets += [("= per-block, no loss_fn", block_peak, False), ("70%, no loss_fn", 0.7, False),
                    ("90%, no loss_fn", 0.9, False)]
    for fraction in (1.0, 0.5, 0.3):
        compiled = step_of(torch.compile(model, backend=torch_budget_backend(fraction, backend)))
        peak = measured(compiled)
        key = "compiled" if fraction == 1.0 else f"torch {fraction:g}"
        methods[key] = (compiled, {"method": f"torch.compile, activation_memory_budget {fraction:g}",
                                   "measured peak": format_bytes(peak)})
        if fraction < 1.0:
            budgets.append((f"= torch {fraction:g}", peak, True))
            methods[f"compile_backend = torch {fraction:g}"] = compiled_plan(
                compiled_loss(case, name), f"= torch {fraction:g}", peak,
                "inductor" if backend == "inductor" else "aot_eager", limit, {"cost_model": cost_model},
                lambda planned: step_of(torch.compile(model, backend=planned, dynamic=False)), measured)
    budgets += [(f"{f:.0%}", f, True) for f in (0.5, 0.7, 0.9)]
    for label, budget, with_loss in budgets:
        started = time.perf_counter()
        try:
            plan = optremat.plan(model, inputs, budget, loss_fn=loss_fn if with_loss else None, time_limit=limit,
                                 cost_model=cost_model)
        except optremat.InfeasibleBudget as error:
            methods[label] = (None, {"method": "optremat", "budget": label,
                                     "predicted peak": f"infeasible (smallest {format_bytes(error.smallest)})"})
            continue
        seconds = time.perf_counter() - started
        planned = under(model, plan, step)
        peak = measured(planned)
        methods[label] = (planned, {
            "method": "optremat", "budget": label, "predicted peak": format_bytes(plan.predicted_peak_bytes),
            "measured peak": format_bytes(peak), "measured / predicted": f"{peak / plan.predicted_peak_bytes:.3f}",
            "predicted overhead": f"{plan.predicted_overhead:+.1%}", "plan s": f"{seconds:.1f}"})
    _time(methods, rounds, device)
    return [[name] + [fields.get(column, "-") for column in HEADER[1:]] for _, fields in methods.values()]


def _time(methods: dict[str, tuple[Callable[[], Any] | None, dict[str, str]]], rounds: int, device: str) -> None:
    """Each configuration's median overhead over its baseline (the unplanned step of the
    same mode: a compiled plan's the unplanned compiled step, "compiled", whose own is the
    eager step), and each optremat row's median per-round ratio to the peer whose peak it
    was given."""
    runs = {key: run for key, (run, _) in methods.items() if run is not None}
    seconds: dict[str, list[float]] = {key: [] for key in runs}
    ratios: dict[str, list[float]] = {key: [] for key in runs}
    order = random.Random(0)
    for run in runs.values():
        run()
    for _ in range(rounds):
        keys = list(runs)
        order.shuffle(keys)
        for key in keys:
            compiled = key.startswith(("torch", "compile_backend")) and "compiled" in runs
            baseline = _seconds(runs["compiled" if compiled else "unplanned"], device)
            seconds[key].append(_seconds(runs[key], device))
            ratios[key].append(seconds[key][-1] / baseline)
    for key in runs:
        fields = methods[key][1]
        fields["measured overhead (median)"] = f"{statistics.median(ratios[key]) - 1:+.1%}"
        peer = key.split("= ", 1)[1].split(",")[0] if "= " in key else None
        if peer in runs:
            fields["optremat / peer (median)"] = f"{statistics.median(m / p for m, p in zip(seconds[key], seconds[peer])):.3f}"


def compiled_plan(loss_fn: Callable[[Any], torch.Tensor] | None, label: str, budget: int, inner: str, limit: float,
                  pricing: dict[str, Any], compiled_step: Callable[[Backend], Callable[[], Any]],
                  measured: Callable[[Callable[[], Any]], int], method: str = "optremat compile_backend"
                  ) -> tuple[Callable[[], Any] | None, dict[str, str]]:
    """`optremat.compile_backend` at `budget` bytes (`label` names it), pricing `loss_fn`
    (its ops priced by `pricing`: `cost_model` and `device`):
    the step `compiled_step(backend)` makes (None when infeasible) and its row's fields.
    Where the plan chose the chunks of a `loss_fn`'s LM head, the step installs them
    before each run, as other rows' plans install theirs on the same head."""
    backend = optremat.compile_backend(budget, inner=inner, time_limit=limit, loss_fn=loss_fn, **pricing)
    method = f"{method} ({inner})"
    started = time.perf_counter()
    step = compiled_step(backend)
    try:
        peak = measured(step)
    except torch._dynamo.exc.BackendCompilerFailed as error:
        if not isinstance(error.inner_exception, optremat.InfeasibleBudget):
            raise
        smallest = format_bytes(error.inner_exception.smallest)
        return None, {"method": method, "budget": label, "predicted peak": f"infeasible (smallest {smallest})"}
    plan = backend.plans[0]
    if plan.chunking is not None and loss_fn is not None:
        step = _installing(step, loss_fn, plan.chunking.chunks)
    return step, {"method": method, "budget": label, "predicted peak": format_bytes(plan.predicted_peak_bytes),
                  "head": "whole" if plan.chunking is None or plan.chunking.chunks is None
                  else f"{plan.chunking.chunks} chunks",
                  "measured peak": format_bytes(peak), "measured / predicted": f"{peak / plan.predicted_peak_bytes:.3f}",
                  "predicted overhead": f"{plan.predicted_overhead:+.1%}",
                  "plan s": f"{sum(p.solve_seconds for p in backend.plans):.1f} (compile {time.perf_counter() - started:.0f})"}


def _installing(step: Callable[[], Any], loss_fn: optremat.CausalLMLoss, chunks: int | None) -> Callable[[], Any]:
    def run() -> Any:
        install(loss_fn.weights(substituted=False)[0], chunks)
        return step()
    return run


def _seconds(run: Callable[[], Any], device: str) -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    begin = time.perf_counter()
    run()
    sync()
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt-mini,resnet-mini,llama,hf-resnet")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--limit", type=float, default=20.0)
    parser.add_argument("--cost-model", default="roofline", choices=COST_MODELS,
                        help="op costs optremat's plans are priced with: the roofline model, or each op timed here")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--backend", default="aot_eager_decomp_partition",
                        help="what torch.compile runs the peers' partitions with (e.g. inductor)")
    parser.add_argument("--out", help="the page to write (default: native.md here on a CPU, "
                                      "native_<device>.md under $OUT or here on a GPU)")
    args = parser.parse_args()
    keep_compiled()
    if args.device == "cpu":
        torch.set_num_threads(2)
        machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, no GPU"
        out = Path(__file__).with_name("native.md")
    else:
        machine = f"{torch.cuda.get_device_name(args.device)}, {os.cpu_count()} host cores"
        out = Path(os.environ.get("OUT", Path(__file__).parent)) / f"native_{args.device.split(':')[0]}.md"
    out = Path(args.out) if args.out else out
    command = " ".join(["python -m benchmarks.native"] + sys.argv[1:])
    head = ["# Native runtime at equal measured peak", "",
            f"Machine: {machine}, torch {torch.__version__}. Command: `{command}`.", "",
            __doc__.split("\n\n", 2)[2].strip(), ""]
    write_rows(out, head, HEADER, (rows(name, args.rounds, args.limit, args.device, args.backend, args.cost_model)
                                   for name in args.models.split(",")))


if __name__ == "__main__":
    main()
