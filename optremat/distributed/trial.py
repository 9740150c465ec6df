"""One rank's measured training step under a data-parallel plan (for `run_local`): the
plan's predicted peak beside the measured one (`rank_peak`), its decisions, the whole
gradients (`whole_gradients`), and step times against the same job unplanned."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
import torch.distributed as dist
import torch.nn as nn

from optremat.core.sharding import Parallel
from optremat.distributed.agree import plan
from optremat.distributed.local import run_local
from optremat.distributed.wrap import held_by_rank, wrap
from optremat.models import CrossEntropy, Example, build
from optremat.runtime.apply import apply
from optremat.runtime.measure import measure_peak

WARM_UP = 2
"""Steps before the measured one: DDP rebuilds its buckets in the second step's forward."""


MEASURED = 5
"""Measurements of the step, of which the least is reported: a buffer a collective frees
on gloo's own thread is never seen freed by the profiler, which can only overstate a peak."""


STEPS_TIMED = 3
"""Consecutive steps in one timing: a single CPU step of a small model is mostly noise."""


@dataclass(frozen=True)
class RankStep:
    """What one rank saw. `gradients` (rank 0 only) are the whole model's after the
    measured step; `ratios` are planned over unplanned step times, one per round."""

    rank: int
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    predicted_overhead: float
    decisions: str
    gradients: dict[str, np.ndarray] | None
    ratios: tuple[float, ...] = ()


def rank_step(model_name: str, batch: int, budget: float | int | str, parallel: Parallel, rounds: int = 0,
              time_limit: float = 5.0) -> RankStep:
    """On each rank of a running process group: `model_name` (built-in) at `batch` samples
    per rank (this rank's slice of one batch of world * batch), planned for `budget` per
    rank, applied, wrapped, and stepped once under measurement after warm-up steps (the
    last of them measured too, so the gradients it leaves count until the step frees them).
    With `rounds`, planned and unplanned steps then alternate that many times."""
    rank, world = dist.get_rank(), dist.get_world_size()
    example = _slice(build(model_name, batch=world * batch), rank, world)
    model = example.model
    made = plan(model, example.inputs, budget, parallel, loss_fn=example.loss_fn, time_limit=time_limit)
    step = _step(example)
    apply(model, made)
    wrapped = wrap(model, made.parallel)
    for _ in range(WARM_UP):
        step(wrapped)
    peak = rank_peak(model, wrapped, example.inputs, lambda: step(wrapped))
    gradients = whole_gradients(model)
    ratios = _ratios(wrapped, model_name, batch, made.parallel, example, step, rounds) if rounds else ()
    return RankStep(rank, made.budget_bytes, made.predicted_peak_bytes, peak, made.predicted_overhead,
                    json.dumps([r.to_json() for r in made.regions]), gradients if rank == 0 else None, ratios)


def _slice(example: Example, rank: int, world: int) -> Example:
    """This rank's share of a batch: inputs and targets cut along dimension 0."""
    share = lambda t: t.chunk(world)[rank].contiguous()  # noqa: E731
    loss = example.loss_fn
    if not isinstance(loss, CrossEntropy):
        raise TypeError(f"cannot split the loss {type(loss).__name__} across ranks")
    return Example(example.model, tuple(share(x) for x in example.inputs), replace(loss, target=share(loss.target)))


def _step(example: Example) -> Callable[[nn.Module], None]:
    def step(module: nn.Module) -> None:
        for p in example.model.parameters():
            p.grad = None
        out = module(*example.inputs)
        example.loss_fn(out).backward()

    return step


def rank_peak(model: nn.Module, wrapped: nn.Module, inputs: Any, step: Callable[[], None]) -> int:
    """This rank's measured peak bytes of `step` on top of what it holds between steps
    (`held_by_rank`) and `inputs`: the least of `MEASURED` measurements, each also
    measuring a step before it, so the gradients that step leaves count until freed."""
    return min(measure_peak(step, resident=[held_by_rank(model, wrapped), inputs], setup=step).peak_bytes
               for _ in range(MEASURED))


def whole_gradients(model: nn.Module) -> dict[str, np.ndarray]:
    """Every parameter's whole gradient (gathered from the shards under FSDP): every rank
    must call this, as it is a collective."""
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name] = grad.detach().numpy().copy()
    return out


def _ratios(wrapped: nn.Module, model_name: str, batch: int, parallel: Parallel, example: Example,
            step: Callable[[nn.Module], None], rounds: int) -> tuple[float, ...]:
    """Planned over unplanned step time in `rounds` rounds (the same model and inputs,
    wrapped the same way, without the plan), each timing `STEPS_TIMED` steps, which of
    the two runs first alternating."""
    rank, world = dist.get_rank(), dist.get_world_size()
    plain = _slice(build(model_name, batch=world * batch), rank, world)
    unplanned = wrap(plain.model, parallel)
    plain_step = _step(plain)
    plain_step(unplanned)
    runs = {"planned": lambda: step(wrapped), "unplanned": lambda: plain_step(unplanned)}
    out = []
    for k in range(rounds):
        seconds = {}
        for name in sorted(runs, reverse=bool(k % 2)):
            dist.barrier()
            started = time.perf_counter()
            for _ in range(STEPS_TIMED):
                runs[name]()
            dist.barrier()
            seconds[name] = time.perf_counter() - started
        out.append(seconds["planned"] / seconds["unplanned"])
    return tuple(out)


def gradients_of(model_name: str, batch: int) -> dict[str, np.ndarray]:
    """The single-process unplanned step's gradients on a batch of `batch` samples."""
    example = build(model_name, batch=batch)
    example.loss_fn(example.model(*example.inputs)).backward()
    return {name: p.grad.detach().numpy().copy() for name, p in example.model.named_parameters()}


def run(model_name: str, batch: int, budget: Any, parallel: Parallel, world: int, rounds: int = 0,
        time_limit: float = 5.0) -> list[RankStep]:
    """`rank_step` on `world` local ranks."""
    return run_local(rank_step, world, model_name, batch, budget, parallel, rounds, time_limit)
