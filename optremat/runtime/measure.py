"""Measure the real peak memory of a training step.

On CUDA the allocator's own statistics are exact. On CPU the profiler's memory events
(every allocation and free the CPU allocator sees, kernel temporaries included) are
summed in time order; a storage-tracking dispatch mode would miss allocations made
outside dispatch, such as checkpoint's saved RNG state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch._C._autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._pytree import tree_leaves


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
    records = prof.profiler.kineto_results.events()
    deltas = sorted((e.start_ns(), e.nbytes()) for e in records
                    if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
    start, end = next(((e.start_ns(), e.end_ns()) for e in records if e.name() == _STEP), (0, 0))
    kept = sum(delta for at, delta in deltas if at < start)
    live = peak = kept
    for at, delta in deltas:
        if start <= at <= end or not end:
            live += delta
            peak = max(peak, live)
    return PeakMemory(before, peak)


def measure_step(model: torch.nn.Module, inputs: tuple, loss_fn: Callable[[Any], torch.Tensor],
                 device: str = "cpu") -> PeakMemory:
    """Peak memory of one eager forward+backward of `loss_fn(model(*inputs))`, after a warm-up.

    Parameters, buffers and inputs count as resident; gradients are returned, not
    accumulated, so repeated calls measure the same step.
    """
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(loss_fn(model(*inputs)), params)

    step()
    return measure_peak(step, resident=[list(model.parameters()), list(model.buffers()), inputs], device=device)
