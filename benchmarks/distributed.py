"""Per-rank plans for data-parallel training: measured on two gloo ranks, simulated at scale.

    python -m benchmarks.distributed [--rounds 15] [--limit 20] [--skip-measured] [--skip-simulated]

Measured: the built-in gpt-mini (two samples per rank) on two local CPU processes (gloo),
under FSDP2 (`fully_shard` on every block, then the model) and DDP, planned by
`optremat.distributed.plan` at 2 budgets each (fractions of one rank's unplanned
peak). Each rank's predicted peak is set beside the peak measured on it (the profiler's
allocations in the step, plus the rank's parameter shards, inputs and DDP's buckets),
and the step overhead is the median over `rounds` rounds of planned over unplanned time
for three steps (the same job wrapped the same way without the plan, which goes first
alternating, with barriers), with the quartiles of those ratios: two ranks share the two
cores, so single rounds vary widely.

Simulated: Llama-shaped models built from transformers' `LlamaConfig` on the meta device
(1B: Llama 3.2 1B's shape; 7B: Llama 2 7B's), one sequence of 4096 tokens per rank,
bfloat16 weights and activations, flash attention (memory linear in the sequence), the
model's own loss from `labels` (transformers' cross-entropy over float32 logits), AdamW
state in float32 (4 bytes per bfloat16 parameter byte), FSDP2 over 8 and 64 ranks with
every decoder layer a unit, ops priced by the H100 roofline. Per-block checkpointing
(every decoder layer checkpointed whole, as HF's `gradient_checkpointing_enable()` and
torchtitan's full AC do, the LM head whole) is priced by the same simulator, and
optremat is planned, its LM head whole or in token chunks as the plan chooses, with its
peak as the budget, at 60% and 80% of it (and, where those are out of reach, at the least
peak their search found), and at budgets between it and the unplanned peak.

The simulated rows are predictions: no GPU ran them, and the GPU effects the model leaves
out (CUDA streams holding freed buffers, FSDP2's forward prefetch) would add to them. The
measured overheads come from the CPU, where the roofline cost model prices
recomputation below what it takes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import optremat
from benchmarks.report import machine, table
from optremat import DDP, FSDP, Region
from optremat.core.graph import format_bytes
from optremat.distributed.trial import run
from optremat.plots import plot_lines

OUT = Path(__file__).resolve().parent / "distributed.md"
MEASURED = [(FSDP(units=("blocks.*",)), 0.75), (FSDP(units=("blocks.*",)), 0.85), (DDP(), 0.8), (DDP(), 0.9)]
LLAMAS = {
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
    "llama-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                     intermediate_size=11008, vocab_size=32000),
}
SEQUENCE, RANKS, ADAMW = 4096, (8, 64), 4.0
BETWEEN = (0.25, 0.5)
"""optremat's further budgets: these fractions of the way from per-block's peak to the unplanned one."""
BELOW = (0.6, 0.8)
"""and these fractions of per-block's peak, which only an LM head in chunks reaches; where
one is out of reach, the least peak that search found is planned too."""
LEAST = "least found"


def measured(rounds: int, limit: float) -> list[list[str]]:
    rows = []
    for parallel, budget in MEASURED:
        steps = run("gpt-mini", 2, budget, parallel, 2, rounds=rounds, time_limit=limit)
        for step in steps:
            quartiles = statistics.quantiles(step.ratios, n=4) if len(step.ratios) > 1 else [float("nan")] * 3
            overhead = quartiles[1] - 1
            rows.append([type(parallel).__name__, f"{budget:.0%}", str(step.rank), format_bytes(step.budget_bytes),
                         format_bytes(step.predicted_peak_bytes), format_bytes(step.measured_peak_bytes),
                         f"{step.measured_peak_bytes / step.predicted_peak_bytes:.3f}",
                         f"{step.predicted_overhead:+.1%}",
                         f"{overhead:+.1%} ({quartiles[0] - 1:+.0%} to {quartiles[2] - 1:+.0%})",
                         "yes" if step.decisions == steps[0].decisions else "NO"])
            print(" | ".join(rows[-1]), flush=True)
    return rows


def llama(name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A Llama-shaped model on the meta device (no memory) and its batch: the model
    computes its own loss from `labels`."""
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    AttentionInterface.register("fused_causal", flash_attention)
    config = LlamaConfig(**LLAMAS[name], max_position_embeddings=SEQUENCE, use_cache=False,
                         attn_implementation="fused_causal")
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    tokens = torch.zeros(1, SEQUENCE, dtype=torch.long, device="meta")
    return model, {"input_ids": tokens, "labels": tokens}


def flash_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention through PyTorch's flash kernel for the CPU, which keeps only the
    output and its log-sum-exp for the backward, as flash attention does on a GPU."""
    repeat = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, True)[0]
    return out.transpose(1, 2).contiguous(), None


def simulated(limit: float) -> tuple[list[list[str]], dict[str, list[tuple[float, float]]], dict]:
    rows, lines, marks = [], {}, {}
    for name in LLAMAS:
        model, batch = llama(name)
        layers = [Region(f"model.layers.{i}", 0) for i in range(model.config.num_hidden_layers)]
        params = sum(p.numel() for p in model.parameters())
        for world in RANKS:
            parallel = FSDP(units=("model.layers.*",), world=world, optimizer_state=ADAMW)
            options = dict(parallel=parallel, device="h100")
            per_block = optremat.price_regions(model, batch, layers, head_chunks=None, **options)
            unplanned, block_peak = per_block.baseline_peak_bytes, per_block.predicted_peak_bytes
            label = f"{name}, {world} ranks"
            rows.append([name, f"{params / 1e9:.2f}B", str(world), format_bytes(unplanned), "per-block",
                         format_bytes(block_peak), format_bytes(block_peak), "whole",
                         f"{per_block.predicted_overhead:+.1%}", "-"])
            print(" | ".join(rows[-1]), flush=True)
            marks[f"per-block, {label}"] = [(block_peak / 2**30, 100 * per_block.predicted_overhead)]
            lines[f"optremat, {label}"] = []
            budgets = [(f"{f:.0%} of per-block", int(block_peak * f)) for f in BELOW] + [("= per-block", block_peak)]
            budgets += [("", int(block_peak + step * (unplanned - block_peak))) for step in BETWEEN]
            least_tried = False
            while budgets:
                note, budget = budgets.pop(0)
                started = time.perf_counter()
                try:
                    made = optremat.plan(model, batch, budget, time_limit=limit, **options)
                except optremat.InfeasibleBudget as error:
                    rows.append([name, f"{params / 1e9:.2f}B", str(world), format_bytes(unplanned),
                                 f"optremat ({note})", format_bytes(budget),
                                 f"infeasible (least {format_bytes(error.smallest)})", "-", "-",
                                 f"{time.perf_counter() - started:.0f}"])
                    print(" | ".join(rows[-1]), flush=True)
                    if error.smallest < block_peak and not least_tried:
                        budgets.insert(0, (LEAST, error.smallest))
                        least_tried = True
                    continue
                chunks = made.chunking.chunks
                rows.append([name, f"{params / 1e9:.2f}B", str(world), format_bytes(unplanned),
                             "optremat" + (f" ({note})" if note else ""), format_bytes(budget),
                             format_bytes(made.predicted_peak_bytes), "whole" if chunks is None else f"{chunks} chunks",
                             f"{made.predicted_overhead:+.1%}", f"{time.perf_counter() - started:.0f}"])
                print(" | ".join(rows[-1]), flush=True)
                lines[f"optremat, {label}"].append((made.predicted_peak_bytes / 2**30, 100 * made.predicted_overhead))
    return rows, lines, marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--limit", type=float, default=20.0, help="solver time limit per plan, seconds")
    parser.add_argument("--skip-measured", action="store_true", help="keep the page's measured section as it is")
    parser.add_argument("--skip-simulated", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    sections = [f"# Data-parallel plans\n\nMachine: {machine()}. Regenerate with `python -m benchmarks.distributed`"
                f" (--rounds {args.rounds} --limit {args.limit:g}).", __doc__.split("\n\n", 2)[2].strip()]
    if args.skip_measured:  # kept as the page has it
        sections += [part for part in _sections() if part.startswith("## Measured")]
    else:
        rows = measured(args.rounds, args.limit)
        sections.append("## Measured: gpt-mini on 2 gloo ranks\n\n" + table(
            ["wrap", "budget", "rank", "budget bytes", "predicted peak", "measured peak", "measured / predicted",
             "predicted overhead",
             f"measured overhead: median of {args.rounds} rounds (quartiles)", "same decisions as rank 0"],
            rows))
    if not args.skip_simulated:
        rows, lines, marks = simulated(args.limit)
        plot = OUT.with_name("distributed_llama.png")
        plot_lines(plot, lines, "Per-rank peak and overhead, Llama shapes, seq 4096, FSDP2",
                   "per-rank peak (GiB)", "predicted overhead (%)", marks=marks)
        sections.append("## Simulated: Llama shapes at 8 and 64 ranks\n\n" + table(
            ["model", "parameters", "ranks", "unplanned per-rank peak", "method", "budget", "per-rank peak",
             "LM head", "predicted overhead", "plan s"], rows) + f"\n\n![per-rank peak and overhead]({plot.name})")
    sections.append(f"Total time {time.perf_counter() - started:.0f} s.")
    OUT.write_text("\n\n".join(sections) + "\n")
    print(f"wrote {OUT}")


def _sections() -> list[str]:
    """The page's sections as it is now, each from its "## " heading."""
    if not OUT.exists():
        return []
    return ["## " + part.strip() for part in OUT.read_text().split("\n## ")[1:]]


if __name__ == "__main__":
    main()
