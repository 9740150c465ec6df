"""A causal LM trained by transformers' Trainer under an optremat memory budget, and checked.

A Llama built from its config (random weights, nothing downloaded) trains on synthetic
text of varying length: a word-level tokenizer made in memory,
`DataCollatorForLanguageModeling(mlm=False, pad_to_multiple_of=32)` padding each batch to
a multiple of 32 tokens (so batches fall in a few shape buckets), two batches accumulated
per optimizer step. `PlanCallback(budget=0.6)` plans the first batch at 60% of its
unplanned peak and each other bucket on its first step. The same training runs
unplanned with the same seed, and the script checks that:

- every optimizer step's loss equals the unplanned run's within 1e-5 (float32);
- each bucket was planned once (the first batch's plan serves its own bucket);
- at each bucket one planned training step, measured with the CPU profiler
  (`optremat.runtime.measure.measure_step`), peaks at most 2% over the bucket's budget.
  The peak of a whole Trainer run is not compared with a budget: it also holds AdamW's
  state and the Trainer's own buffers, which a plan of one step does not price.

    python examples/trainer_causal_lm.py              # 20 optimizer steps, lengths 40 to 256
    python examples/trainer_causal_lm.py --smoke      # 4 steps on two buckets (the test runs it)

Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
import transformers

from optremat.core.graph import format_bytes
from optremat.integrations.transformers import PlanCallback
from optremat.runtime.measure import measure_step

WORDS = 500
BATCH = 4
ACCUMULATE = 2
MULTIPLE = 32
BUDGET = 0.6
LOSS_TOLERANCE = 1e-5
PEAK_SLACK = 1.02


@dataclass(frozen=True)
class Bucket:
    """One padded shape the training stepped on, its plan's figures and the measured peak."""

    shape: tuple[int, ...]
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int


@dataclass(frozen=True)
class Report:
    """What the planned run did against the unplanned one."""

    losses: list[float]
    unplanned_losses: list[float]
    buckets: list[Bucket]
    shapes_seen: int
    first_plan_reused: bool
    planning_seconds: float

    def failures(self) -> list[str]:
        """The checks that failed, each as a sentence (none when all pass)."""
        found = []
        if len(self.losses) != len(self.unplanned_losses) or any(
                abs(a - b) > LOSS_TOLERANCE for a, b in zip(self.losses, self.unplanned_losses)):
            found.append(f"losses differ from the unplanned run's: {self.losses} against {self.unplanned_losses}")
        if len(self.buckets) != self.shapes_seen or not self.first_plan_reused:
            found.append(f"{len(self.buckets)} plans for {self.shapes_seen} shapes (the first batch's plan "
                         f"{'was' if self.first_plan_reused else 'was not'} reused at its shape)")
        for bucket in self.buckets:
            if bucket.measured_peak_bytes > PEAK_SLACK * bucket.budget_bytes:
                found.append(f"shape {list(bucket.shape)}: measured peak {format_bytes(bucket.measured_peak_bytes)} "
                             f"over its budget {format_bytes(bucket.budget_bytes)}")
        return found

    def __str__(self) -> str:
        worst = max(abs(a - b) for a, b in zip(self.losses, self.unplanned_losses))
        lines = [f"{len(self.losses)} optimizer steps, losses {self.losses[0]:.4f} ... {self.losses[-1]:.4f}; "
                 f"largest difference from the unplanned run {worst:.1e}",
                 f"{len(self.buckets)} plans for {self.shapes_seen} batch shapes, "
                 f"{self.planning_seconds:.1f} s planning in all",
                 "shape (batch, tokens)   budget     predicted  measured   measured/budget"]
        for b in self.buckets:
            lines.append(f"{str(list(b.shape)):22s}  {format_bytes(b.budget_bytes):>9s}  "
                         f"{format_bytes(b.predicted_peak_bytes):>9s}  {format_bytes(b.measured_peak_bytes):>9s}  "
                         f"{b.measured_peak_bytes / b.budget_bytes:.3f}")
        return "\n".join(lines)


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the words w0 ... w499, made in memory."""
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(WORDS)}}
    inner = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="[PAD]", unk_token="[UNK]")


def texts(tokenizer: transformers.PreTrainedTokenizerFast, count: int, shortest: int,
          longest: int) -> list[dict[str, list[int]]]:
    """`count` tokenized texts of random words, each `shortest` to `longest` words long."""
    draw = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=draw).tolist()
    return [tokenizer(" ".join(f"w{i}" for i in torch.randint(0, WORDS, (n,), generator=draw).tolist()))
            for n in lengths]


def llama(vocab_size: int) -> transformers.LlamaForCausalLM:
    """A 4-layer Llama from its config with random weights (training mode)."""
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=172,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, use_cache=False, pad_token_id=0)
    return transformers.LlamaForCausalLM(config)


class Recording:
    """The collator, recording the shape of every batch it pads."""

    def __init__(self, collator: transformers.DataCollatorForLanguageModeling) -> None:
        self.collator = collator
        self.shapes: set[tuple[int, ...]] = set()

    def __call__(self, features: list) -> dict[str, torch.Tensor]:
        batch = self.collator(features)
        self.shapes.add(tuple(batch["input_ids"].shape))
        return batch


def train(data: list, tokenizer: transformers.PreTrainedTokenizerFast, steps: int, out: Path,
          callbacks: list) -> tuple[transformers.Trainer, Recording]:
    """A seeded Trainer run of `steps` optimizer steps; the Trainer and its recording collator."""
    transformers.set_seed(0)
    collator = Recording(transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False,
                                                                      pad_to_multiple_of=MULTIPLE))
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=BATCH,
                                          gradient_accumulation_steps=ACCUMULATE, logging_steps=1, seed=0,
                                          dataloader_drop_last=True, use_cpu=True, report_to=[],
                                          save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=llama(len(tokenizer)), args=args, train_dataset=data,
                                   data_collator=collator, callbacks=callbacks)
    trainer.train()
    return trainer, collator


def losses(trainer: transformers.Trainer) -> list[float]:
    """The loss logged at every optimizer step."""
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def measured_peak(model: torch.nn.Module, shape: tuple[int, ...], vocab_size: int) -> int:
    """Peak bytes of one planned training step on a batch of `shape`, called as the Trainer
    calls the model (parameters, buffers and the batch resident, the model's own loss),
    its output held through the backward as plans price it (the Trainer drops the logits
    before its backward, so its steps peak lower)."""
    ids = torch.randint(2, vocab_size, shape)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    return measure_step(model, batch).peak_bytes


def run(steps: int, smoke: bool, time_limit: float) -> Report:
    """Train planned and unplanned and measure each bucket's planned step; the smoke run
    plans in the solver's deterministic time, so its plans do not depend on machine load."""
    torch.set_num_threads(1)
    tokenizer = word_tokenizer()
    shortest, longest = (30, 80) if smoke else (40, 256)
    data = texts(tokenizer, steps * BATCH * ACCUMULATE, shortest, longest)
    callback = PlanCallback(BUDGET, time_limit=time_limit, deterministic=smoke)
    with tempfile.TemporaryDirectory() as out:
        unplanned, _ = train(data, tokenizer, steps, Path(out) / "unplanned", [])
        planned, collator = train(data, tokenizer, steps, Path(out) / "planned", [callback])
    plans = callback.replanning.plans
    buckets = sorted((Bucket(_shape(key), plan.budget_bytes, plan.predicted_peak_bytes,
                             measured_peak(planned.model, _shape(key), len(tokenizer)))
                      for key, plan in plans.items()), key=lambda bucket: bucket.shape)
    return Report(losses(planned), losses(unplanned), buckets, len(collator.shapes),
                  any(plan is callback.plan for plan in plans.values()),
                  callback.plan.solve_seconds + callback.replanning.planning_seconds)


def _shape(key: tuple[str, ...]) -> tuple[int, ...]:
    """The (batch, tokens) shape of a Replanning key such as ("int64[4, 96]",) * 3: the
    collator pads attention_mask, input_ids and labels alike."""
    return tuple(int(n) for n in key[0].split("[")[1].rstrip("]").split(","))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (each accumulates 2 batches)")
    parser.add_argument("--smoke", action="store_true", help="4 steps on two length buckets")
    parser.add_argument("--time-limit", type=float, help="seconds of search per plan (10; 0.5 with --smoke)")
    args = parser.parse_args(argv)
    time_limit = args.time_limit or (0.5 if args.smoke else 10.0)
    report = run(4 if args.smoke else args.steps, args.smoke, time_limit)
    print(report)
    failures = report.failures()
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
