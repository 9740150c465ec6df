"""Measure the real peak memory of a training step.

On CUDA the allocator's own statistics are exact. On CPU the profiler's memory events
(every allocation and free the CPU allocator sees, kernel temporaries included) are
summed in time order; a storage-tracking dispatch mode would miss allocations made
outside dispatch, such as checkpoint's saved RNG state.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._pytree import tree_leaves

from optremat.tracing.inputs import call_of, own_loss

_STEP = "optremat.measured_step"


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
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if setup is not None:
            setup()
        with record_function(_STEP):
            step()
    return PeakMemory(before, _window_peak(prof.profiler.kineto_results.experimental_event_tree()))


def _window_peak(roots: list[Any]) -> int:
    """Most bytes live during the measured step: allocations made while profiling, matched
    to their frees by address. A free of memory allocated before profiling is ignored (it
    was never counted), and an allocation at an address still live closes the block that
    held it, whose free the profiler missed (a free on a thread it does not watch)."""
    events, start, end = [], 0, 0
    stack = list(roots)
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        elif node.name == _STEP:
            start, end = node.start_time_ns, node.end_time_ns
    live: dict[int, int] = {}
    total = peak = 0
    for at, ptr, size in sorted(events):
        total -= live.pop(ptr, 0)
        if size > 0:
            live[ptr] = size
            total += size
        if at < start:
            peak = total
        elif at <= end or not end:
            peak = max(peak, total)
    return peak


def measure_step(model: torch.nn.Module, example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                 device: str = "cpu") -> PeakMemory:
    """Peak memory of one eager forward+backward, after a warm-up: `model` called on
    `example_inputs` as `optremat.plan` calls it (a dict as `model(**batch)`, a tuple as
    `model(*args)`), the loss `loss_fn(out)` or, without one, the loss its output carries
    (`outputs.loss`, as a transformers model given `labels` returns it).

    Parameters, buffers, inputs and the tensors `loss_fn` holds count as resident
    (`step_resident`); gradients are returned, not accumulated, so repeated calls measure
    the same step. The model's output is held through the backward, as a training loop
    holding `out = model(x)` holds it.
    """
    args, kwargs = call_of(example_inputs)
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> tuple[torch.Tensor, ...]:
        out = model(*args, **kwargs)
        loss = loss_fn(out) if loss_fn is not None else own_loss(out)
        if loss is None:
            raise ValueError("the model's output carries no loss (no `loss` field): pass loss_fn")
        return torch.autograd.grad(loss, params, allow_unused=True)

    step()
    return measure_peak(step, resident=step_resident(model, (args, kwargs), loss_fn), device=device)
