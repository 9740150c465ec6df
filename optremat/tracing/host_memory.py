"""The most host memory a piece of work allocates, from the profiler's memory events:
every allocation and free the CPU allocator sees, kernel temporaries included, summed in
time order. A storage-tracking dispatch mode would miss allocations made outside
dispatch, such as checkpoint's saved RNG state."""

from __future__ import annotations

from typing import Any, Callable

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

_STEP = "optremat.measured_step"


def host_peak(run: Callable[[], Any], setup: Callable[[], Any] | None = None) -> int:
    """The most bytes live on the host during `run`, of those allocated since it (or
    `setup`, run first, whose allocations that it keeps count as live) began."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if setup is not None:
            setup()
        with record_function(_STEP):
            run()
    return _window_peak(prof.profiler.kineto_results.experimental_event_tree())


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
