"""Measure the real peak memory of a training step.

On CUDA the allocator's own statistics are exact. On CPU the profiler's memory events
are summed in time order (`host_memory.host_peak`).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.utils._pytree import tree_leaves

from optremat.tracing.host_memory import host_peak
from optremat.tracing.inputs import call_of, differentiated, own_loss


@dataclass(frozen=True)
class PeakMemory:
    """Peak bytes of a step: what was resident before it plus the most it allocated on top."""

    resident_bytes: int
    step_peak_bytes: int

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.step_peak_bytes


def resident_bytes(values: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind the tensors in `values` (nested)."""
    seen: dict[int, int] = {}
    for t in tree_leaves(list(values)):
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def step_resident(model: torch.nn.Module, inputs: Any, loss_fn: Callable | None = None) -> list[Any]:
    """What a step of `model` on `inputs` holds before it starts, as a plan prices it:
    parameters, buffers, the inputs, and the tensors `loss_fn` holds from outside the step
    (targets in its closure or its attributes, which the trace records as constants)."""
    return [list(model.parameters()), list(model.buffers()), inputs, _held_by(loss_fn)]


def _held_by(fn: Callable | None) -> list[torch.Tensor]:
    """The tensors in `fn`'s closure and, for a callable object, its attributes."""
    values = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # a cell not yet bound
            continue
    if fn is not None and not isinstance(fn, types.FunctionType):
        values += list(getattr(fn, "__dict__", {}).values())
    return [t for t in tree_leaves(values) if isinstance(t, torch.Tensor)]


def measure_peak(step: Callable[[], Any], resident: Iterable[Any] = (), device: str = "cpu",
                 setup: Callable[[], Any] | None = None) -> PeakMemory:
    """Run `step` once and report its peak memory.

    `resident` lists what is alive before the step and counted in the peak (parameters,
    inputs); the step's own allocations are measured. `setup`, run first, is measured
    too: what it allocates and keeps (DDP's buckets, a warm-up step's gradients) counts
    as live during the step, its own passing peak does not.
    """
    before = resident_bytes(resident)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        if setup is not None:
            setup()
            torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return PeakMemory(before, torch.cuda.max_memory_allocated() - base)
    return PeakMemory(before, host_peak(step, setup))




def measure_step(model: torch.nn.Module, example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                 device: str = "cpu") -> PeakMemory:
    """Peak memory of one eager forward+backward, after a warm-up: `model` called on
    `example_inputs` as `optremat.plan` calls it (a dict as `model(**batch)`, a tuple as
    `model(*args)`), the loss `loss_fn(out)` or, without one, the loss its output carries
    (`inputs.own_loss`: `outputs.loss`, as a transformers model given `labels` returns it).

    Parameters, buffers, inputs and the tensors `loss_fn` holds count as resident
    (`step_resident`); gradients (of the parameters and of the inputs that require grad)
    are returned, not accumulated, so repeated calls measure the same step. The model's
    output is held through the backward, as a training loop holding `out = model(x)`
    holds it.
    """
    args, kwargs = call_of(example_inputs)
    params = [p for p in model.parameters() if p.requires_grad]
    params += differentiated((args, kwargs))

    def step() -> tuple[torch.Tensor, ...]:
        out = model(*args, **kwargs)
        loss = loss_fn(out) if loss_fn is not None else own_loss(out)
        if loss is None:
            raise ValueError("the model's output carries no loss (no `loss` field, and no scalar of an output tuple "
                             "computed from its other tensors): pass loss_fn")
        return torch.autograd.grad(loss, params, allow_unused=True)

    step()
    return measure_peak(step, resident=step_resident(model, (args, kwargs), loss_fn), device=device)
