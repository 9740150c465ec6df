"""What planning costs when batch shapes vary: 200 padded batches under `Replanning`.

    python -m benchmarks.variable_shapes [--batches 200] [--time-limit 5]

A 4-layer Llama from its transformers config trains (AdamW, its own loss from `labels`)
on batches of 4 sequences of 40 to 256 tokens, each batch padded to a multiple of 32
tokens, so that batches fall in 7 shape buckets. The first batch is planned at 60% of its
unplanned peak and applied with `optremat.Replanning(0.6, cache=...)`: each new bucket is
planned on its first step. The loop runs three times: unplanned, planned with an empty
plan cache, and planned again with the cache filled (every plan loaded, only tracing
paid). Then the plan made at the largest bucket is repriced (`optremat.reprice`) at each
smaller bucket, to show whether one plan would have served them all. Writes
benchmarks/variable_shapes.md.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

import optremat
from optremat.core.graph import format_bytes

OUT = Path(__file__).with_name("variable_shapes.md")
VOCAB = 502
BATCH = 4
MULTIPLE = 32
SHORTEST, LONGEST = 40, 256
BUDGET = 0.6
Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Run:
    """One pass over the batches: its wall time, the time spent planning, the plans by bucket."""

    seconds: float
    planning_seconds: float
    plans: dict[int, optremat.Plan]


def llama() -> transformers.LlamaForCausalLM:
    """The model, seeded: every pass starts from the same weights."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      use_cache=False, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).train()


def batches(count: int) -> list[Batch]:
    """`count` batches of token rows of random lengths, right-padded to a multiple of 32
    tokens as `DataCollatorForLanguageModeling(pad_to_multiple_of=32)` pads them."""
    draw = torch.Generator().manual_seed(0)
    made = []
    for _ in range(count):
        lengths = torch.randint(SHORTEST, LONGEST + 1, (BATCH,), generator=draw)
        width = -(-int(lengths.max()) // MULTIPLE) * MULTIPLE
        mask = (torch.arange(width) < lengths[:, None]).long()
        ids = torch.randint(2, VOCAB, (BATCH, width), generator=draw) * mask
        made.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return made


def train(model: torch.nn.Module, data: list[Batch]) -> float:
    """Seconds to train one step on each batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    started = time.perf_counter()
    for batch in data:
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return time.perf_counter() - started


def planned(data: list[Batch], cache: Path, time_limit: float) -> Run:
    """A pass planned on its first batch and replanned at each new bucket."""
    model = llama()
    started = time.perf_counter()
    first = optremat.plan(model, data[0], BUDGET, time_limit=time_limit, cache=cache)
    first_seconds = time.perf_counter() - started
    replan = optremat.Replanning(BUDGET, cache=cache, time_limit=time_limit)
    optremat.apply(model, first, replan=replan)
    seconds = first_seconds + train(model, data)
    plans = {int(key[0].split(", ")[1].rstrip("]")): plan for key, plan in replan.plans.items()}
    return Run(seconds, first_seconds + replan.planning_seconds, plans)


def reprice_largest(data: list[Batch], plans: dict[int, optremat.Plan]) -> dict[int, optremat.Plan]:
    """The largest bucket's plan priced at every bucket, on a batch of that bucket."""
    model = llama()
    largest = plans[max(plans)]
    example = {len(b["input_ids"][0]): b for b in data}
    return {width: optremat.reprice(largest, model, example[width]) for width in plans}


def table(cold: Run, warm: Run, unplanned: float, repriced: dict[int, optremat.Plan], count: int,
          data: list[Batch]) -> list[str]:
    widths = [len(b["input_ids"][0]) for b in data]
    rows = ["| bucket (tokens) | batches | planning s, empty cache | own plan: budget (60%) | predicted peak | "
            "predicted overhead | largest bucket's plan repriced: peak | overhead | within own budget |",
            "|---|---|---|---|---|---|---|---|---|"]
    for width, plan in sorted(cold.plans.items()):
        other = repriced[width]
        rows.append(f"| {width} | {widths.count(width)} | {plan.solve_seconds:.1f} | {format_bytes(plan.budget_bytes)} | "
                    f"{format_bytes(plan.predicted_peak_bytes)} | {plan.predicted_overhead:+.1%} | "
                    f"{format_bytes(other.predicted_peak_bytes)} | {other.predicted_overhead:+.1%} | "
                    f"{'yes' if other.predicted_peak_bytes <= plan.budget_bytes else 'no'} |")
    return [
        "| pass | plans | planning s | planning s per batch | wall s | wall s per batch |",
        "|---|---|---|---|---|---|",
        f"| unplanned | 0 | 0 | 0 | {unplanned:.1f} | {unplanned / count:.3f} |",
        f"| planned, empty plan cache | {len(cold.plans)} | {cold.planning_seconds:.1f} | "
        f"{cold.planning_seconds / count:.3f} | {cold.seconds:.1f} | {cold.seconds / count:.3f} |",
        f"| planned, plans loaded from the cache | {len(warm.plans)} | {warm.planning_seconds:.1f} | "
        f"{warm.planning_seconds / count:.3f} | {warm.seconds:.1f} | {warm.seconds / count:.3f} |",
        "",
        *rows,
    ]


def verdict(cold: Run, repriced: dict[int, optremat.Plan]) -> str:
    """Whether the largest bucket's plan, applied alone, would have held every bucket's budget."""
    fits = sum(repriced[w].predicted_peak_bytes <= plan.budget_bytes for w, plan in cold.plans.items())
    largest = cold.plans[max(cold.plans)]
    return (f"Repriced, the largest bucket's plan fits {fits} of the {len(cold.plans)} buckets' own budgets: where "
            f"all fit, planning that bucket alone ({largest.solve_seconds:.1f} s) and applying its plan without "
            f"`Replanning` meets every budget, against {cold.planning_seconds:.1f} s spent planning each bucket.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--time-limit", type=float, default=5.0, help="seconds of search per plan")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = batches(args.batches)
    unplanned = train(llama(), data)
    with tempfile.TemporaryDirectory() as cache:
        cold = planned(data, Path(cache), args.time_limit)
        warm = planned(data, Path(cache), args.time_limit)
    repriced = reprice_largest(data, cold.plans)
    lines = [
        "# Planning cost when batch shapes vary",
        "",
        f"Machine: {platform.machine()}, 2 CPU cores (one torch thread), torch {torch.__version__}, transformers "
        f"{transformers.__version__}. Command: `python -m benchmarks.variable_shapes --batches {args.batches} "
        f"--time-limit {args.time_limit:g}`.",
        "",
        f"{args.batches} batches of {BATCH} sequences of {SHORTEST} to {LONGEST} tokens, padded to a multiple of "
        f"{MULTIPLE}, train a 4-layer Llama (hidden size 64) with AdamW; `Replanning({BUDGET}, cache=...)` plans each "
        "new bucket on its first step at 60% of that bucket's unplanned peak. Planning seconds include tracing; "
        "with the cache filled, each bucket is traced and its plan loaded.",
        "",
        *table(cold, warm, unplanned, repriced, args.batches, data),
        "",
        "The last three columns price the plan made at the largest bucket at each smaller one "
        "(`optremat.reprice`): its peak there against that bucket's own 60% budget, and its overhead.",
        "",
        verdict(cold, repriced),
    ]
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
